"""What reaching each OpenAI-compatible vendor takes: its endpoint, key variable and
``gen_ai.provider.name`` (no client imported: configuration validates with this alone)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiProviderNameValues as _Names,
)

__all__ = ["VENDORS", "Vendor", "VendorName"]

VendorName: TypeAlias = Literal[
    "groq", "mistral", "deepseek", "together", "fireworks", "openrouter", "xai", "vllm"
]


@dataclass(frozen=True, slots=True)
class Vendor:
    """A vendor's endpoint (`base_url`), the variable holding its key, whether its endpoint
    needs one, and its ``gen_ai.provider.name`` (the semantic conventions' value where they
    define one, else the vendor's id in `genai-prices`, which prices it)."""

    base_url: str
    key_variable: str
    key_required: bool
    provider_name: str


VENDORS: dict[str, Vendor] = {
    "groq": Vendor("https://api.groq.com/openai/v1", "GROQ_API_KEY", True, _Names.GROQ.value),
    "mistral": Vendor(
        "https://api.mistral.ai/v1", "MISTRAL_API_KEY", True, _Names.MISTRAL_AI.value
    ),
    "deepseek": Vendor("https://api.deepseek.com", "DEEPSEEK_API_KEY", True, _Names.DEEPSEEK.value),
    "together": Vendor("https://api.together.ai/v1", "TOGETHER_API_KEY", True, "together"),
    "fireworks": Vendor(
        "https://api.fireworks.ai/inference/v1", "FIREWORKS_API_KEY", True, "fireworks"
    ),
    "openrouter": Vendor("https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", True, "openrouter"),
    "xai": Vendor("https://api.x.ai/v1", "XAI_API_KEY", True, _Names.X_AI.value),
    # A server of your own: its key (``vllm serve --api-key``) only if it was started with one.
    "vllm": Vendor("http://localhost:8000/v1", "VLLM_API_KEY", False, "vllm"),
}
"""Each ``provider =`` preset's facts (`VendorName`)."""
