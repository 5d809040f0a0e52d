"""JAX's persistent compilation cache, kept beside the converted weights."""
from __future__ import annotations

import logging
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: Path) -> None:
    """Compiled programs kept under cache_dir/xla across starts; an unwritable cache_dir leaves it off (a warning:
    every start compiles afresh)."""
    path = cache_dir / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cache_dir: cannot write %s (%s); the persistent compilation cache is off", path, e)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
