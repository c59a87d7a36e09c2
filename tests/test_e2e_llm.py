"""End to end: vllm.LLM with a tiny random-weight Llama and our scheduler."""

import pytest

from helpers import needs_cpu_engine, waiting_requests

pytestmark = [pytest.mark.slow, pytest.mark.matrix, needs_cpu_engine]

NEURON = "neuron_scheduler.NeuronScheduler"
LENGTHS = [5, 40, 300, 700, 1500, 20, 90, 1100]  # 700+ are chunked at 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _generate(model, scheduler_cls, neuron_config=None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS

    kwargs = {}
    if scheduler_cls is not None:
        kwargs["scheduler_cls"] = scheduler_cls
        kwargs["additional_config"] = {"neuron_config": neuron_config or {}}
    llm = LLM(
        model=model,
        **TINY_ENGINE_ARGS,
        **kwargs,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 31 + j) % 150 + 4 for j in range(n)])
        for i, n in enumerate(LENGTHS)
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    return result, scheduler


def test_llm_generates_with_neuron_scheduler_and_matches_stock(tiny_model):
    """Greedy outputs equal the stock scheduler's: batching changes only
    which tokens share a forward pass, not what each token attends to, and
    the float32 CPU kernels here are exact enough that the argmax agrees."""
    ours, scheduler = _generate(tiny_model, NEURON, {"num_seqs_buckets": [2, 4, 8]})
    from neuron_scheduler import NeuronScheduler

    assert isinstance(scheduler, NeuronScheduler)
    assert scheduler.neuron_config.num_seqs_buckets == (2, 4, 8)
    assert all(len(tokens) == 12 for tokens in ours)
    totals = scheduler.metrics
    assert totals.prefill_tokens == sum(LENGTHS)
    assert totals.prefill_tokens_padded > totals.prefill_tokens
    assert totals.decode_slots == len(LENGTHS) * 11
    stock, _ = _generate(tiny_model, None)
    assert ours == stock


def test_llm_rejects_bad_neuron_config_at_start(tiny_model):
    with pytest.raises(Exception, match="num_seqs_buckets") as error:
        _generate(tiny_model, NEURON, {"num_seqs_buckets": [1, 3]})
    assert "[1, 3]" in str(error.value)


def test_requests_that_can_never_fit_get_vllms_error_not_a_hang(tiny_model):
    """A prompt longer than max_model_len is refused by vLLM's input check
    (the engine keeps serving), and an engine whose KV cache cannot hold one
    max_model_len request refuses to start: no request ever waits for
    blocks that cannot exist."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS

    args = dict(TINY_ENGINE_ARGS, scheduler_cls=NEURON)
    with pytest.raises(ValueError, match="max seq len"):
        LLM(model=tiny_model, **{**args, "kv_cache_memory_bytes": 1 << 20})
    llm = LLM(model=tiny_model, **args)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    too_long = TokensPrompt(prompt_token_ids=[5] * 3000)
    fine = TokensPrompt(prompt_token_ids=[5] * 10)
    with pytest.raises(VLLMValidationError, match="maximum context length is 2048"):
        llm.generate([fine, too_long], params, use_tqdm=False)
    outputs = llm.generate([fine, fine], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert not waiting_requests(scheduler) and not scheduler.running
