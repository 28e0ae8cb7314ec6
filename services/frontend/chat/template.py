"""The frontend's chat-template renderer: engine_core.text.chat_template, shared with the offline LLM's
chat(). Torch-free."""

from engine_core.text.chat_template import ChatTemplateError, render_chat

__all__ = ["ChatTemplateError", "render_chat"]
