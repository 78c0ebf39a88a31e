"""Test doubles shared by the suite: a backend whose reply is a chosen text."""
from __future__ import annotations

import threading

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.model.template import default_stop_ids


class ScriptedBackend(Backend):
    """Replies with the token ids of ``text`` then ``<|im_end|>``, within max_new_tokens.

    ``gate`` (open by default) is waited on before each token, honouring cancel while closed,
    like a real engine between steps; ``prompts`` records every prompt it was given."""

    def __init__(self, tokenizer, text: str, max_seq_len: int = 4096,
                 name: str = "scripted", *, features: bool = False) -> None:
        super().__init__()
        self._tokenizer = tokenizer
        self.text = text
        self.gate = threading.Event()
        self.gate.set()
        self.prompts: list[list[int]] = []
        # features: it "honours" grammars and logprobs by replying its script (for tests of the
        # API's mapping of those fields)
        self._info = BackendInfo(name, "fake-model", "cpu", "float32", max_seq_len - 1, max_seq_len,
                                 default_stop_ids(tokenizer), grammar=features, logprobs=features)

    def script(self) -> list[int]:
        """The ids a full reply yields: the text's, then <|im_end|>."""
        tok = self._tokenizer
        return tok.encode(self.text, add_special_tokens=False) + [
            tok.convert_tokens_to_ids("<|im_end|>")]

    def stream(self, prompt_ids, params):
        cancel = self._begin()
        self.prompts.append(list(prompt_ids))
        for tid in self.script()[:params.max_new_tokens]:
            while not self.gate.wait(0.005):
                if cancel.is_set():
                    return
            yield tid
            if cancel.is_set():
                return
