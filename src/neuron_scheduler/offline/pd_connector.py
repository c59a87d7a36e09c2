"""vLLM's ``ExampleConnector`` with its lookup made to agree with its store.

vLLM's connector (0.24 to 0.33 alike) stores and loads a prompt's KV under
the key of its first ``align(len)`` tokens (whole blocks, at least the last
token left out: ``(len - 1) // block_size * block_size``), but looks a
prompt up under ``align(len - 1)``: the two differ when ``len - 1`` is a
multiple of the block size (prompts of 33, 65, 97, ... tokens at block
size 32). Measured on this machine with the read-mode proxy: a 65-token
prompt found nothing (its KV was stored under 64 tokens, looked up under
32), and a 97-token prompt that shared 64 tokens with an earlier one was
found under 64, then loaded under 96, a file that did not exist: the decode
engine died (``FileNotFoundError`` in its worker). vLLM's own example flow
hides it by sending the decode side the prompt plus the prefill's token.

``AlignedExampleConnector`` looks up under the key it stores and loads
under, and finds a prompt only when its folder holds files (the folder is
created before the first layer's file is written). Everything else is
vLLM's connector unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)

#: ``kv_connector`` name and module for ``--kv-transfer-config``.
CONNECTOR_NAME = "AlignedExampleConnector"
CONNECTOR_MODULE = __name__


def stored_prompt_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens the connector stores, finds and loads for a prompt of
    ``prompt_len``: whole blocks, the last token always left to compute."""
    return max(0, (prompt_len - 1) // block_size * block_size)


class AlignedExampleConnector(ExampleConnector):
    """``ExampleConnector`` whose lookup uses the store's key."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._found_match_for_request(request):
            return 0, False
        stored = stored_prompt_tokens(
            len(request.prompt_token_ids or []), self._block_size
        )
        return max(0, stored - num_computed_tokens), False

    def _found_match_for_prompt(
        self, prompt_token_ids: list[int], mm_hashes: list[str]
    ) -> bool:
        import torch

        stored = stored_prompt_tokens(len(prompt_token_ids), self._block_size)
        folder = self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:stored], mm_hashes, create_folder=False
        )
        return os.path.isdir(folder) and bool(os.listdir(folder))
