"""Where experiments run when there are several slots: this machine's GPUs (`local`) or a Ray cluster (`ray`).

A slot runs one experiment at a time; slots.py turns `--gpus` into slots ("0,0": two slots on GPU 0 that take
turns training, so that one experiment is proposed and evaluated while the other trains).
An executor says where a slot works and where its run happens: `worktree(loop, slot)` gives the slot's tree,
`train(loop, ctx, x, budget, seed)` runs one committed experiment and returns (run result, early-stop status);
`open(loop)`/`close()` take and give back what it holds. The scheduler keeps the queue, the decisions,
results.tsv and the hooks.
"""
