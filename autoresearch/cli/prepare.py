"""CLI command: prepare (download or collect a data source, train the tokenizer, tokenize)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from autoresearch.cli.app import app, console, err_console


@app.command()
def prepare(
    source: Annotated[str, typer.Argument(help="climbmix, files, builtin (offline) or builtin-site (offline, big)")],
    path: Annotated[Optional[Path], typer.Option(help="folder of .parquet/.jsonl/.txt files (source `files`)")] = None,
    name: Annotated[Optional[str], typer.Option(help="dataset name in the cache (default: the source)")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="BPE vocab size (default: the profile's)")] = None,
    shards: Annotated[Optional[int], typer.Option(help="climbmix training shards (default: 10)")] = None,
    val_shard: Annotated[Optional[int], typer.Option(help="climbmix validation shard (default: 6542)")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="climbmix download URL")] = None,
    max_bytes: Annotated[Optional[int], typer.Option(help="cap the corpus at about this much text")] = None,
    workers: Annotated[int, typer.Option(help="parallel downloads")] = 8,
) -> None:
    """Get a dataset into the cache and tokenize it, so that train.py can run on it."""
    from autoresearch.harness import data, env

    vocab = vocab_size or env.resolve_profile().vocab_size
    tok = data.prepare(source, cache=env.default_cache(), vocab_size=vocab, name=name, path=path,
                       num_shards=shards, base_url=base_url, workers=workers, max_bytes=max_bytes,
                       val_shard=val_shard, progress=lambda msg: err_console.print(msg, style="dim", highlight=False))
    meta = data.load_meta(tok)
    console.print(f"prepared {meta['dataset']} ({source}): {meta['train']['tokens']:,} train and "
                  f"{meta['val']['tokens']:,} validation tokens, vocab {meta['vocab_size']}, in {tok}",
                  highlight=False, soft_wrap=True)
