"""vLLM's LLM class: batches of prompts or chats run to completion on an in-process engine core.

    from engine_core import LLM, SamplingParams
    llm = LLM()                                      # the embedded SmolLM2; LLM("path/to/model.gguf")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16, stop=["."]))
    print(outputs[0].outputs[0].text)

Text in, text out, through the model's own tokenizer and chat template; no gRPC and no frontend.
"""

from __future__ import annotations

from dataclasses import replace

from engine_core.config import EngineConfig
from engine_core.engine_args import EngineArgs
from engine_core.offline.llm_engine import LLMEngine, PromptType
from engine_core.protocol import OutputKind, RequestOutput, SamplingParams
from engine_core.text.chat_template import render_chat
from engine_core.text.tokenizer import TokenizerBundle

Conversation = list[dict]  # [{"role": "user", "content": "..."}, ...]


class LLM:
    """`LLM(model=None, **options)`: options are EngineArgs' (dtype, max_model_len, seed, enforce_eager, ...);
    or `LLM(config=EngineConfig(...))` for every engine option."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **engine_args) -> None:
        if config is not None and (model is not None or engine_args):
            raise ValueError("give either config=EngineConfig(...) or the model and EngineArgs' options, not both")
        self.llm_engine = LLMEngine(config or EngineArgs(model=model, **engine_args).create_engine_config())

    def get_tokenizer(self) -> TokenizerBundle:
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 lora_name: str | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order. `prompts`: a str, token ids, vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]}, or a list of them; `sampling_params`: one for all or one each (None: the
        defaults). Every output is whole (FINAL_ONLY, whatever output_kind says, as in vLLM)."""
        batch = [prompts] if _is_one_prompt(prompts) else list(prompts)
        if isinstance(sampling_params, list):
            params = [_final_only(p) for p in sampling_params]
        else:
            params = _final_only(sampling_params or SamplingParams())
        return self.llm_engine.generate(batch, params, lora_names=lora_name)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, lora_name: str | None = None) -> list[RequestOutput]:
        """Chat messages rendered with the model's own chat template (or `chat_template`), then generated as
        `generate` does; one RequestOutput per conversation (`prompt` is the rendered text)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        template = chat_template or tokenizer.chat_template
        if not template:
            raise ValueError("this model has no chat template: pass chat_template=..., or use generate()")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        texts = []
        for conversation in conversations:
            text = render_chat(template, conversation, add_generation_prompt=add_generation_prompt,
                               bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
            if continue_final_message:  # cut what the template appends after the last message
                final = conversation[-1]["content"]
                end = text.rfind(final)
                text = text[:end + len(final)] if final and end >= 0 else text
            texts.append(text)
        # the template writes the special tokens itself, as the frontend's Chat tokenizes it
        token_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(token_ids, sampling_params, lora_name=lora_name)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs


def _is_one_prompt(prompts) -> bool:
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and all(isinstance(t, int) for t in prompts))


def _final_only(params: SamplingParams) -> SamplingParams:
    return replace(params, output_kind=OutputKind.FINAL_ONLY)
