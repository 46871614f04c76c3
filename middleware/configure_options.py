"""The configure-options layer: shape each request's options before the inner client sees them."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from pipeline.client import Answer, ChatClient, DelegatingChatClient, check_options, raising
from pipeline.types import ChatOptions, ChatResponseUpdate, Messages

__all__ = ["ConfigureOptionsChatClient", "OptionsConfigurer"]

OptionsConfigurer = Callable[[ChatOptions], ChatOptions | None]


class ConfigureOptionsChatClient(DelegatingChatClient):
    """Applies `configure` to a clone of each request's options.

    `configure` receives a fresh clone (an empty `ChatOptions` when the caller passed none)
    and may change it in place and return `None`, or return other options. The caller's
    object is never mutated, and nothing carries over from one request to the next.
    """

    keeps_raw_answers = True  # observes, never changes answers (`pipeline._forward`)

    def __init__(
        self, inner: ChatClient, configure: OptionsConfigurer, *, leave_open: bool = False
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        if not callable(configure):
            raise TypeError("configure must be a callable taking and returning ChatOptions")
        self._configure = configure

    def _options(self, options: ChatOptions | None) -> ChatOptions:
        options = check_options(options)
        base = options.clone() if options is not None else ChatOptions()
        result = self._configure(base)
        if result is None:
            return base
        if not isinstance(result, ChatOptions):
            raise TypeError(
                f"configure must return ChatOptions or None, not {type(result).__name__}"
            )
        # A configurer that returns the caller's own object (or any shared one) must not let
        # the inner layers mutate it, so anything but our clone is cloned again.
        return result if result is base else result.clone()

    def get_response(self, messages: Messages, options: ChatOptions | None = None) -> Answer:
        # The inner call's coroutine, not one of our own around it (`ChatPipeline`'s reason).
        try:
            configured = self._options(options)
        except Exception as exc:
            return raising(exc)
        return self.inner.get_response(messages, configured)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self.inner.get_streaming_response(messages, self._options(options))
