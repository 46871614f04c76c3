"""Google's Gemini API (``generateContent``, on the Gemini API and on Vertex AI): its
vocabulary (`vocab`) and the codec a provider uses (`outbound`). The gateway does not serve
this API, so there is no inbound codec."""
