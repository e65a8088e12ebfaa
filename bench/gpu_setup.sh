# Sourced by the GPU bench scripts (repo root, wheels in .whl/): install the carried wheels and this package
# (unless SKIP_INSTALL is set), then say which machine, python and torch the figures come from.
if [[ -z ${SKIP_INSTALL:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . 2>&1 | grep -v WARNING | tail -2
fi
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
