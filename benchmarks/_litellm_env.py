"""The environment the benchmarks start LiteLLM in: off the network (local copies of its
remote data, no .env loading, no database), errors only, and without the caller's
credentials. The compatibility suite (`tests/compat/conftest.py`) uses the same settings."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

LITELLM_ENV = {
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOG": "ERROR",
}
DROPPED_ENV = ("DATABASE_URL", "LITELLM_MASTER_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL")


def litellm_env(
    extra: Mapping[str, str] | None = None, dropped: Iterable[str] = ()
) -> dict[str, str]:
    """This process's environment without `DROPPED_ENV` and `dropped`, with `LITELLM_ENV`
    and `extra` set."""
    leave_out = {*DROPPED_ENV, *dropped}
    env = {k: v for k, v in os.environ.items() if k not in leave_out}
    env.update(LITELLM_ENV)
    env.update(extra or {})
    return env
