"""One package per wire API: what each API means, written once (vocabulary, outbound and inbound codecs)."""
