"""Amazon Bedrock's Converse API: `vocab` (its tables) and `outbound` (a core request as a
Converse body, its answers and stream events as core types). The gateway does not serve this
API, so there is no inbound codec."""
