"""OpenAI's Chat Completions API."""
