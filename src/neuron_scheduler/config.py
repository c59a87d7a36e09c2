"""``neuron_config``: the scheduler's options, parsed and validated once at
engine start. Every error names the key and the offending value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuron_scheduler.admission import KvAdmission
from neuron_scheduler.buckets import (
    default_seq_buckets,
    default_token_buckets,
    validate_buckets,
)

#: Key under ``additional_config`` that holds our options.
NEURON_CONFIG_KEY = "neuron_config"

#: The bucket lists a static graph's shape is padded to (prefill tokens,
#: decode batch, decode context): what ``tune`` chooses and a profile covers.
SHAPE_BUCKET_KEYS = (
    "num_batched_tokens_buckets",
    "num_seqs_buckets",
    "decode_context_length_buckets",
)


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings the scheduler's shapes derive from."""

    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    #: KV block size (0: not known here; block-size checks are skipped).
    block_size: int = 0

    @property
    def max_prefill_tokens(self) -> int:
        """Largest prefill chunk the engine can produce."""
        return min(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True)
class NeuronConfig:
    """Validated scheduler options.

    Attributes:
        num_batched_tokens_buckets: prefill token buckets, ascending, last =
            ``min(max_num_batched_tokens, max_model_len)``.
        num_seqs_buckets: decode batch-size buckets, ascending, last =
            ``max_num_seqs``.
        max_prefills_per_batch: new prompts packed into one prefill step
            (their tokens together within the largest token bucket);
            at most ``max_num_seqs``.
        kv_admission: how the KV cache limits admission (``KvAdmission``).
        max_consecutive_prefill_steps: after this many prefill steps in a row
            with decodes waiting, one decode step runs (``None``: no bound).
        max_prefill_tokens_with_decodes_waiting: while decodes wait, a
            prefill step holds at most this many tokens (longer prompts are
            chunked), bounding each stall in time (``None``: no cap).
        decode_context_length_buckets: context lengths decode graphs are
            compiled for, ascending, last = ``max_model_len``.
        compile_buckets: ``StaticShapeWorker`` runs every bucket shape once
            at start (compiling it, unless ``enforce_eager``) and records the
            seconds each took.
        kv_segment_size: AWS's ``kv_segment_size_buckets`` (its one value):
            every prefill chunk and prefix-cache hit starts at a multiple of
            it (``None``: block-aligned, as vLLM does).
        strict_prefill: the rule of runners like AWS's: a request whose
            prompt is not fully computed is a prefill, even when only its
            last token is left (a prompt end never joins a decode step), and
            a step holds at most one prefill.
        decode_split_break_even_positions: a decode batch is split in two by
            context (``decode_groups``) when that reads more than this many
            KV positions fewer than one step: one decode step's fixed cost
            (weights, launch) in KV positions (``None``: never split).
        kv_loads_take_slots: a request loading its KV from a KV connector
            (and one loaded, waiting to run) takes one of ``max_num_seqs``'
            slots: a decode engine of a disaggregated pair pulls KV only
            when it has a free slot, as AWS's plugin does (default: loads
            are bounded by the KV rule only, as in vLLM).
        kv_load_timeout_s: a request waiting this many seconds for its KV
            from a KV connector fails (``kv_load_timeout``); ``None``: it
            waits as long as the connector takes, as in vLLM.
    """

    num_batched_tokens_buckets: tuple[int, ...]
    num_seqs_buckets: tuple[int, ...]
    max_prefills_per_batch: int = 1
    kv_admission: KvAdmission = KvAdmission.MAX_MODEL_LEN
    max_consecutive_prefill_steps: int | None = None
    max_prefill_tokens_with_decodes_waiting: int | None = None
    decode_context_length_buckets: tuple[int, ...] = ()
    compile_buckets: bool = False
    kv_segment_size: int | None = None
    strict_prefill: bool = False
    decode_split_break_even_positions: int | None = None
    kv_loads_take_slots: bool = False
    kv_load_timeout_s: float | None = None

    @property
    def prompt_end_slack(self) -> int:
        """Prompt tokens a request may have left and still run as a decode
        row: 1 (a prompt end), or 0 under ``strict_prefill``."""
        return 0 if self.strict_prefill else 1

    @classmethod
    def defaults(cls, limits: EngineLimits) -> NeuronConfig:
        return cls.from_dict({}, limits)

    @classmethod
    def from_dict(cls, raw: object, limits: EngineLimits) -> NeuronConfig:
        """Parse ``additional_config["neuron_config"]``.

        Raises ``ValueError`` for a non-dict, an unknown key, a wrong type or
        an invalid list; nothing is fixed silently.
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"additional_config[{NEURON_CONFIG_KEY!r}] must be a JSON object, "
                f"got {type(raw).__name__} {raw!r}"
            )
        unknown = sorted(str(key) for key in raw if key not in _KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown neuron_config key(s) {unknown}; known keys: "
                f"{sorted(_KNOWN_KEYS)}"
            )
        token_buckets = (
            validate_buckets(
                "num_batched_tokens_buckets",
                raw["num_batched_tokens_buckets"],
                limits.max_prefill_tokens,
            )
            if "num_batched_tokens_buckets" in raw
            else default_token_buckets(limits.max_prefill_tokens)
        )
        seq_buckets = (
            validate_buckets(
                "num_seqs_buckets", raw["num_seqs_buckets"], limits.max_num_seqs
            )
            if "num_seqs_buckets" in raw
            else default_seq_buckets(limits.max_num_seqs)
        )
        context_buckets = (
            _context_buckets(raw["decode_context_length_buckets"], limits)
            if "decode_context_length_buckets" in raw
            else (limits.max_model_len,)
        )
        max_prefills = _positive_int(raw, "max_prefills_per_batch", default=1)
        if max_prefills > limits.max_num_seqs:
            raise ValueError(
                f"neuron_config['max_prefills_per_batch'] = {max_prefills!r} exceeds "
                f"max_num_seqs = {limits.max_num_seqs}"
            )
        stall_bound = raw.get("max_consecutive_prefill_steps")
        if stall_bound is not None:
            stall_bound = _positive_int(raw, "max_consecutive_prefill_steps", 1)
        stall_tokens = raw.get("max_prefill_tokens_with_decodes_waiting")
        if stall_tokens is not None:
            stall_tokens = _positive_int(
                raw, "max_prefill_tokens_with_decodes_waiting", 1
            )
            if stall_tokens > token_buckets[-1]:
                raise ValueError(
                    "neuron_config['max_prefill_tokens_with_decodes_waiting'] = "
                    f"{stall_tokens!r} exceeds the largest token bucket "
                    f"{token_buckets[-1]}"
                )
        compile_buckets = _bool(raw, "compile_buckets")
        strict_prefill = _bool(raw, "strict_prefill")
        if strict_prefill and max_prefills > 1:
            raise ValueError(
                "neuron_config['strict_prefill'] allows one prefill per step; "
                f"max_prefills_per_batch = {max_prefills!r}"
            )
        segment = _kv_segment_size(raw, token_buckets, limits)
        split = raw.get("decode_split_break_even_positions")
        if split is not None:
            split = _positive_int(raw, "decode_split_break_even_positions", 1)
        if segment is not None and stall_tokens is not None and stall_tokens % segment:
            raise ValueError(
                "neuron_config['max_prefill_tokens_with_decodes_waiting'] = "
                f"{stall_tokens!r} is not a multiple of kv_segment_size_buckets "
                f"[{segment}]: chunks would start off a segment"
            )
        return cls(
            num_batched_tokens_buckets=token_buckets,
            num_seqs_buckets=seq_buckets,
            max_prefills_per_batch=max_prefills,
            kv_admission=_kv_admission(raw.get("kv_admission", "max_model_len")),
            max_consecutive_prefill_steps=stall_bound,
            max_prefill_tokens_with_decodes_waiting=stall_tokens,
            decode_context_length_buckets=context_buckets,
            compile_buckets=compile_buckets,
            kv_segment_size=segment,
            strict_prefill=strict_prefill,
            decode_split_break_even_positions=split,
            kv_loads_take_slots=_bool(raw, "kv_loads_take_slots"),
            kv_load_timeout_s=_positive_seconds(raw, "kv_load_timeout_s"),
        )


_KNOWN_KEYS = frozenset(
    {
        "num_batched_tokens_buckets",
        "num_seqs_buckets",
        "max_prefills_per_batch",
        "kv_admission",
        "max_consecutive_prefill_steps",
        "max_prefill_tokens_with_decodes_waiting",
        "decode_context_length_buckets",
        "compile_buckets",
        "kv_segment_size_buckets",
        "strict_prefill",
        "decode_split_break_even_positions",
        "kv_loads_take_slots",
        "kv_load_timeout_s",
    }
)

#: AWS's vLLM Neuron plugin: decode context buckets are multiples of this,
#: each below ``max_model_len``, which is implied as the last.
AWS_CONTEXT_MULTIPLE = 128
#: AWS's plugin: the KV segment sizes it accepts.
AWS_KV_SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)


def _context_buckets(value: object, limits: EngineLimits) -> tuple[int, ...]:
    """``decode_context_length_buckets`` in our form (ascending, ending at
    ``max_model_len``) or AWS's (every entry below ``max_model_len``, each a
    multiple of 128; ``max_model_len`` implied as the last bucket)."""
    key = "decode_context_length_buckets"
    entries = list(value) if isinstance(value, (list, tuple)) else []
    aws_form = (
        bool(entries)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in entries)
        and entries[-1] < limits.max_model_len
    )
    if not aws_form:
        return validate_buckets(key, value, limits.max_model_len)
    for entry in entries:
        if entry % AWS_CONTEXT_MULTIPLE:
            raise ValueError(
                f"neuron_config[{key!r}] below max_model_len ({limits.max_model_len}) "
                f"is AWS's form, whose entries are multiples of "
                f"{AWS_CONTEXT_MULTIPLE}: got {entry!r} in {entries!r} (or end the "
                f"list at {limits.max_model_len})"
            )
    return validate_buckets(key, [*entries, limits.max_model_len], limits.max_model_len)


def _kv_segment_size(
    raw: Mapping[str, Any], token_buckets: tuple[int, ...], limits: EngineLimits
) -> int | None:
    """AWS's ``kv_segment_size_buckets``: one size in ``AWS_KV_SEGMENT_SIZES``,
    divisible by the block size, equal to the token buckets when both are
    given (AWS's rules); ours also needs the largest token bucket to be a
    multiple of it, so that chunks after the first start on a segment."""
    key = "kv_segment_size_buckets"
    if key not in raw:
        return None
    value = raw[key]
    if (
        not isinstance(value, list)
        or len(value) != 1
        or value[0] not in AWS_KV_SEGMENT_SIZES
        or isinstance(value[0], bool)
    ):
        raise ValueError(
            f"neuron_config[{key!r}] must be one size of {list(AWS_KV_SEGMENT_SIZES)} "
            f"in a list, got {value!r}"
        )
    (segment,) = value
    if limits.block_size and segment % limits.block_size:
        raise ValueError(
            f"neuron_config[{key!r}] = {value!r} is not divisible by the block "
            f"size {limits.block_size}"
        )
    given = raw.get("num_batched_tokens_buckets")
    if given is not None and list(given) != value:
        raise ValueError(
            f"neuron_config[{key!r}] = {value!r} must equal "
            f"num_batched_tokens_buckets when both are set, got {list(given)!r}"
        )
    if token_buckets[-1] % segment:
        raise ValueError(
            f"neuron_config[{key!r}] = {value!r}: the largest token bucket "
            f"{token_buckets[-1]} (min(max_num_batched_tokens, max_model_len)) "
            "must be a multiple of it, or chunks after the first would start "
            "off a segment"
        )
    return segment


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"neuron_config[{key!r}] must be true or false, got "
            f"{type(value).__name__} {value!r}"
        )
    return value


def _kv_admission(value: object) -> KvAdmission:
    choices = [mode.value for mode in KvAdmission]
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"neuron_config['kv_admission'] must be one of {choices}, got "
            f"{type(value).__name__} {value!r}"
        )
    return KvAdmission(value)


def _positive_int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"neuron_config[{key!r}] must be an int, got {type(value).__name__} "
            f"{value!r}"
        )
    if value <= 0:
        raise ValueError(f"neuron_config[{key!r}] must be positive, got {value!r}")
    return value


def _positive_seconds(raw: Mapping[str, Any], key: str) -> float | None:
    """``raw[key]`` as seconds > 0 (a finite number), or ``None`` if unset."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"neuron_config[{key!r}] must be a number of seconds, got "
            f"{type(value).__name__} {value!r}"
        )
    if not 0 < value < float("inf"):
        raise ValueError(
            f"neuron_config[{key!r}] must be positive and finite, got {value!r}"
        )
    return float(value)
