"""Pipeline layers. Each module holds one layer; routers live in `middleware.routing`."""

from middleware.configure_options import ConfigureOptionsChatClient
from middleware.logging import LoggingChatClient

__all__ = ["ConfigureOptionsChatClient", "LoggingChatClient"]
