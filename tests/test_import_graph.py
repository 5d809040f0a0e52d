"""The modules of every package (pallas_kernels, jaxpage, serving, benchmarks) import each other without cycles,
and each layer imports only the layers below it (jaxpage/testing/structure.py's LAYERS: serving -> jaxpage ->
kernels, never sideways or up). Every import counts: inside functions and under ``if TYPE_CHECKING:``
too (a lazy or annotation-only import hides a cycle; it does not remove it)."""
from __future__ import annotations

import importlib

import pytest

from jaxpage.testing.structure import PRODUCT_PACKAGES, find_cycle, import_graph, module_names, upward_imports


def test_the_module_graph_has_no_cycle():
    graph = import_graph()
    assert graph["jaxpage.engine.llm_engine"] >= {"jaxpage.core.scheduler", "jaxpage.engine.output_processor"}, \
        "graph misread"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph()
    assert {"pallas_kernels.common", "jaxpage.cpu_kernels.kv_write", "benchmarks.throughput"} <= set(graph)
    assert upward_imports(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_layer_check_finds_an_upward_import():
    graph = {"jaxpage.config": {"jaxpage.attention.kv_cache"}, "jaxpage.attention.kv_cache": set(),
             "jaxpage.engine.cli": {"serving.server"}, "serving.server": set()}
    assert upward_imports(graph) == [
        "jaxpage.config (base) imports jaxpage.attention.kv_cache (attention)",
        "jaxpage.engine.cli (engine) imports serving.server (serving)"]


def test_imports_in_functions_and_under_type_checking_count(tmp_path):
    """The old cycle (config -> kv_cache in a function, kv_cache -> config under TYPE_CHECKING) is found."""
    (tmp_path / "jaxpage" / "attention").mkdir(parents=True)
    (tmp_path / "serving").mkdir()
    (tmp_path / "jaxpage" / "config.py").write_text("def kv_dtype():\n    from jaxpage.attention.kv_cache import f\n")
    (tmp_path / "jaxpage" / "attention" / "kv_cache.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxpage.config import ModelConfig\n")
    assert find_cycle(import_graph(tmp_path)) == ["jaxpage.attention.kv_cache", "jaxpage.config",
                                                 "jaxpage.attention.kv_cache"]


@pytest.mark.parametrize("name", sorted(module_names(packages=PRODUCT_PACKAGES)))
def test_each_module_imports_on_its_own(name):
    importlib.import_module(name)
