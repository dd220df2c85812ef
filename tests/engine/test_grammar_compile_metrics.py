"""Specification: an engine's GrammarCompiler times each compilation it runs (k3serve:structured_output_compile_
seconds) and counts each constraint it serves without compiling (k3serve:structured_output_grammar_cache_hits):
a new constraint is observed once, a cached one never again; a constraint that does not compile is refused with
ConstraintCompileError (the API's 400) and observes nothing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.engine.constraint import ConstraintCompileError
from k3serve.engine.structured_output import GrammarCompiler
from k3serve.engine.structured_output_metrics import grammar_compile_metrics
from k3serve.model.tokenizer import Tokenizer

MODEL = "tiny"


def test_compile_seconds_observed_once_for_a_new_constraint_not_for_a_cached_one(tiny_checkpoint):
    registry = CollectorRegistry()
    compiler = GrammarCompiler(Tokenizer.from_dir(tiny_checkpoint), 512,
                               metrics=grammar_compile_metrics(registry).bind(MODEL))

    def value(name: str) -> float:
        return registry.get_sample_value(f"k3serve:structured_output_{name}", {"model_name": MODEL})

    assert (value("compile_seconds_count"), value("grammar_cache_hits_total")) == (0, 0)  # exported from the start
    compiler.compile(StructuredOutputsParams(regex="[ab]{5}"))
    assert value("compile_seconds_count") == 1 and value("compile_seconds_sum") > 0
    compiler.compile(StructuredOutputsParams(regex="[ab]{5}"))
    assert (value("compile_seconds_count"), value("grammar_cache_hits_total")) == (1, 1)
    compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    assert (value("compile_seconds_count"), value("grammar_cache_hits_total")) == (2, 1)
    with pytest.raises(ConstraintCompileError, match="regex does not compile"):
        compiler.compile(StructuredOutputsParams(regex="[ab"))
    assert (value("compile_seconds_count"), value("grammar_cache_hits_total")) == (2, 1)
    compiler.close()


def test_a_registry_gets_its_collectors_once():
    registry = CollectorRegistry()
    assert grammar_compile_metrics(registry) is grammar_compile_metrics(registry)
