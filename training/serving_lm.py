"""A served language model (task `causal_lm`): next-token logits, per-row losses and greedy generation.

Part of the MLflow pyfunc `training/serving_model.py`: registration ships this
file beside it (the model's `code_paths`), and the pyfunc imports it as
`serving_lm` (in a checkout or trainer image, `training.serving_lm`). Like the
pyfunc it imports only numpy, pandas and the standard library (`tokenizers` for a
BPE model's text), so a serving image needs none of trainyard or torch for it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd

LM_OUTPUTS = ("next_token_logits", "token_nll")
"""What a `causal_lm` model's `predict` returns, by `params["output"]` (the first is the default)."""
LM_BATCH_ROWS = 256  # rows per forward pass of a served language model (bounds its activation memory)


class CausalLM:
    """A served language model: next-token logits, per-row losses and greedy generation over an exported program.

    `next_token_logits` reads a row longer than `block_size` by its last `block_size`
    tokens (the model's context). `token_nll` takes rows of 2..`block_size + 1` tokens
    (position t predicts token t + 1) and returns each row's mean loss in nats, so
    exp of the token-weighted mean over a split is the served model's perplexity.
    The tokenizer is `tokenizer.json` in the model directory (`Tokenizer`).

    `run` maps int64 ids `[N, T]` to logits `[N, T, V]`; `meta` is the model directory's `meta.json`.
    """

    def __init__(self, run: Callable[[np.ndarray], np.ndarray], meta: dict[str, Any], model_dir: str) -> None:
        self._run = run
        self.vocab_size: int = meta["vocab_size"]
        self.block_size: int = meta["block_size"]
        self.eos_id: Optional[int] = meta.get("eos_id")
        self._tokenizer_path = os.path.join(model_dir, meta["tokenizer"]) if meta.get("tokenizer") else None
        self._tokenizer: Optional[Tokenizer] = None

    def rows(self, model_input: Any, shortest: int, longest: Optional[int]) -> list[np.ndarray]:
        """Each row's token ids (int64), checked: `shortest`..`longest` (None: any number of) tokens, ids inside the
        vocabulary.

        Raises:
            ValueError: naming the 1-based row, what it holds and what is accepted.
        """
        if isinstance(model_input, pd.DataFrame):
            if "tokens" not in model_input.columns:
                raise ValueError(
                    f"a language model's input is a DataFrame with a 'tokens' column (a list of token ids per row), "
                    f"got columns {list(model_input.columns)}"
                )
            cells = list(model_input["tokens"])
        else:
            cells = list(np.asarray(model_input)) if not isinstance(model_input, list) else model_input
        out = []
        for i, cell in enumerate(cells, start=1):
            ids = np.asarray(cell)
            if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
                raise ValueError(f"row {i}: expected a list of integer token ids, got {str(cell)[:100]}")
            if len(ids) < shortest or (longest is not None and len(ids) > longest):
                raise ValueError(
                    f"row {i} holds {len(ids)} tokens; this output reads {shortest} to {longest or 'any number of'} "
                    f"tokens (block_size {self.block_size})"
                )
            bad = ids[(ids < 0) | (ids >= self.vocab_size)]
            if bad.size:
                raise ValueError(f"row {i}: token id {int(bad[0])} is outside the vocabulary 0..{self.vocab_size - 1}")
            out.append(ids.astype(np.int64))
        return out

    def _logits(self, batch: np.ndarray) -> np.ndarray:
        """Logits `[N, T, V]` (float32) of equal-length rows, `LM_BATCH_ROWS` at a time."""
        parts = [
            np.asarray(self._run(np.ascontiguousarray(batch[s : s + LM_BATCH_ROWS])))
            for s in range(0, len(batch), LM_BATCH_ROWS)
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def predict(self, model_input: Any, params: Optional[dict[str, Any]] = None) -> np.ndarray:
        """The last position's logits `[N, V]`, or with `params={"output": "token_nll"}` each row's mean next-token loss
        `[N]`.

        Rows are run in groups of equal length (a request may mix lengths).

        Raises:
            ValueError: an unknown `output`, or a row `rows` refuses.
        """
        output = (params or {}).get("output") or LM_OUTPUTS[0]
        if output not in LM_OUTPUTS:
            raise ValueError(f"params output={output!r}; a language model serves {list(LM_OUTPUTS)}")
        nll = output == "token_nll"
        rows = (
            self.rows(model_input, 2, self.block_size + 1)
            if nll
            else [r[-self.block_size :] for r in self.rows(model_input, 1, None)]
        )
        result = (
            np.zeros(len(rows), dtype=np.float64) if nll else np.zeros((len(rows), self.vocab_size), dtype=np.float32)
        )
        for length in sorted({len(r) for r in rows}):
            where = [i for i, r in enumerate(rows) if len(r) == length]
            batch = np.stack([rows[i] for i in where])
            if not nll:
                result[where] = self._logits(batch)[:, -1, :]
                continue
            logits = self._logits(batch[:, :-1]).astype(np.float64)
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_norm = np.log(np.exp(shifted).sum(axis=-1))
            target = np.take_along_axis(shifted, batch[:, 1:, None], axis=-1)[..., 0]
            result[where] = (log_norm - target).mean(axis=1)
        return result

    def tokenizer(self) -> "Tokenizer":
        """The tokenizer shipped with the model (read on first use: predicting needs none).

        Raises:
            ValueError: the model was exported without one.
        """
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ValueError(
                    "this language model was exported without a tokenizer (meta.json 'tokenizer' is empty); "
                    "it serves token ids only"
                )
            with open(self._tokenizer_path, encoding="utf-8") as f:
                self._tokenizer = Tokenizer(f.read())
        return self._tokenizer

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32) -> str:
        """The greedy continuation of `prompt` (text, or token ids as they are): the most likely next token,
        `max_new_tokens`
        times or until end-of-document, each step reading the last `block_size` tokens. Returns the new text only.

        Raises:
            ValueError: `max_new_tokens` is negative, or the prompt encodes to no tokens.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be 0 or more")
        tokenizer = self.tokenizer()
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else self.rows([list(prompt)], 1, None)[0].tolist()
        if not ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens; give at least one character")
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = np.asarray([(ids + new)[-self.block_size:]], dtype=np.int64)
            token = int(self._logits(context)[0, -1].argmax())
            if token == self.eos_id:
                break
            new.append(token)
        return tokenizer.decode(new)


class Tokenizer:
    """A model's tokenizer from its `tokenizer.json`: the `tokenizers` library's JSON (needs that package),
    or `{"type": "bytes", ...}`: the UTF-8 bytes are the ids (ids of 256 and above, such as end-of-document, decode to
    nothing)."""

    def __init__(self, text: str) -> None:
        spec = json.loads(text)
        self._bytes = isinstance(spec, dict) and spec.get("type") == "bytes"
        self._library: Any = None
        if not self._bytes:
            from tokenizers import (
                Tokenizer as LibraryTokenizer,
            )  # only for a BPE model's text; predicting needs no tokenizer

            self._library = LibraryTokenizer.from_str(text)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self._bytes else list(self._library.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        if self._bytes:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self._library.decode(ids))
