"""StaticShapeWorker: every forward pass inside vLLM runs at the shape
NeuronScheduler padded the step to, the padding is what the design says,
and greedy outputs equal the stock engine's (in-process, and with the
worker in its own process receiving pickled scheduler outputs)."""

import pytest

from helpers import needs_cpu_engine
from neuron_scheduler.step import StepKind

pytestmark = [pytest.mark.slow, pytest.mark.matrix, needs_cpu_engine]

LENGTHS = [5, 40, 300, 700, 1500, 20, 90, 1100]  # 700+ are chunked at 512
NEURON_CONFIG = {
    "num_seqs_buckets": [2, 4, 8],
    "num_batched_tokens_buckets": [64, 128, 256, 512],
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _llm(model, *, static=True, **overrides):
    from vllm import LLM

    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS

    kwargs = {**TINY_ENGINE_ARGS, **overrides}
    if static:
        kwargs.update(
            scheduler_cls="neuron_scheduler.NeuronScheduler",
            worker_cls="neuron_scheduler.StaticShapeWorker",
            additional_config={
                "neuron_config": overrides.pop("neuron_config", NEURON_CONFIG)
            },
        )
        kwargs.pop("neuron_config", None)
    return LLM(model=model, **kwargs)


def _generate(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 31 + j) % 150 + 4 for j in range(n)])
        for i, n in enumerate(LENGTHS)
    ]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [
        list(o.outputs[0].token_ids)
        for o in llm.generate(prompts, params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def stock_tokens(tiny_model):
    """vLLM's own engine: stock scheduler, stock CPU worker."""
    llm = _llm(tiny_model, static=False)
    tokens = _generate(llm)
    del llm
    return tokens


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def test_every_forward_runs_a_bucket_shape_with_the_designs_padding(
    tiny_model, stock_tokens
):
    llm = _llm(tiny_model)
    runner = _runner(llm)
    seen = []

    def record(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        shape = runner._shape
        actual = shape.actual_tokens
        seen.append((shape, len(input_ids)))
        # Padding: pad ids; a prefill's positions repeat its last real one,
        # a dummy decode row is at position 0.
        assert (input_ids[actual:] == runner.pad_token_id).all()
        expected = positions[actual - 1] if shape.kind is StepKind.PREFILL else 0
        assert (positions[actual:] == expected).all()

    hook = runner.model.register_forward_pre_hook(record, with_kwargs=True)
    tokens = _generate(llm)
    hook.remove()
    assert tokens == stock_tokens
    buckets = NEURON_CONFIG
    kinds = {shape.kind for shape, _ in seen}
    assert kinds == {StepKind.PREFILL, StepKind.DECODE}
    for shape, length in seen:
        assert length == shape.tokens  # the model ran the padded length
        if shape.kind is StepKind.PREFILL:
            assert length in buckets["num_batched_tokens_buckets"]
        else:
            assert shape.rows in buckets["num_seqs_buckets"] and length == shape.rows
    assert sum(runner.forward_shapes.values()) == len(seen)
    assert any(length > shape.actual_tokens for shape, length in seen)  # padded
    del llm


def test_padded_shapes_reach_a_worker_in_another_process(tiny_model, stock_tokens):
    """distributed_executor_backend='mp': the worker is a separate process
    and receives each NeuronSchedulerOutput pickled."""
    llm = _llm(tiny_model, distributed_executor_backend="mp")
    assert _generate(llm) == stock_tokens
    (counts,) = llm.collective_rpc("forward_shape_counts")
    assert counts and all(
        int(key.split(":")[1])
        in NEURON_CONFIG[
            "num_batched_tokens_buckets"
            if key.startswith("prefill")
            else "num_seqs_buckets"
        ]
        for key in counts
    )
    del llm


def test_shapes_outside_the_buckets_and_unpadded_outputs_raise(tiny_model):
    from vllm.v1.core.sched.output import SchedulerOutput

    from neuron_scheduler.output import NeuronSchedulerOutput
    from neuron_scheduler.worker import StaticShapeError

    llm = _llm(tiny_model, neuron_config={**NEURON_CONFIG, "compile_buckets": True})
    runner = _runner(llm)
    # compile_buckets: every bucket shape ran once at start, timed.
    assert set(runner.compile_seconds) == {
        "warmup",
        *(f"prefill:{t}" for t in NEURON_CONFIG["num_batched_tokens_buckets"]),
        *(f"decode:{r}" for r in NEURON_CONFIG["num_seqs_buckets"]),
    }

    plain = SchedulerOutput.make_empty()
    plain.num_scheduled_tokens = {"a": 100}
    plain.total_num_scheduled_tokens = 100
    with pytest.raises(StaticShapeError, match="NeuronScheduler"):
        runner.static_shape(plain)
    prefill = NeuronSchedulerOutput.adopt(SchedulerOutput.make_empty())
    prefill.num_scheduled_tokens = {"a": 100}
    prefill.total_num_scheduled_tokens = 100
    prefill.total_num_scheduled_tokens_padded = 300
    with pytest.raises(StaticShapeError, match="300 tokens, not a token bucket"):
        runner.static_shape(prefill)
    decode = NeuronSchedulerOutput.adopt(SchedulerOutput.make_empty())
    decode.num_scheduled_tokens = {"a": 1, "b": 1, "c": 1}
    decode.total_num_scheduled_tokens = 3
    decode.num_seqs_padded = 3
    decode.decode_context_len_padded = 2048
    with pytest.raises(StaticShapeError, match="3 rows, not a batch bucket"):
        runner.static_shape(decode)
    decode.num_seqs_padded = 4
    shape = runner.static_shape(decode)
    assert (shape.kind, shape.tokens, shape.rows) == (StepKind.DECODE, 4, 4)
    del llm
