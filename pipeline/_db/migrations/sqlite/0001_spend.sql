-- The spend ledger: one row per provider attempt (and per cache hit), written once.
-- `id` makes inserts idempotent (ON CONFLICT DO NOTHING); costs are integer billionths of
-- the currency unit (NULL: unpriced); times are microseconds since the epoch, UTC; tags are
-- a JSON array of strings.
CREATE TABLE chat_pipeline_spend (
    id TEXT PRIMARY KEY,
    time_us INTEGER NOT NULL,
    request_id TEXT,
    attempt INTEGER NOT NULL,
    route TEXT,
    provider TEXT,
    model_requested TEXT,
    model_served TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    cost_nanos INTEGER,
    currency TEXT NOT NULL DEFAULT 'USD',
    estimated INTEGER NOT NULL DEFAULT 0,
    outcome TEXT NOT NULL,
    cache TEXT,
    saved_nanos INTEGER,
    duration_ms REAL,
    time_to_first_update_ms REAL,
    key_id TEXT,
    key_name TEXT,
    user_id TEXT,
    team TEXT,
    tags TEXT NOT NULL DEFAULT '[]',
    endpoint TEXT,
    session TEXT
) WITHOUT ROWID;
CREATE INDEX chat_pipeline_spend_time ON chat_pipeline_spend (time_us);
CREATE INDEX chat_pipeline_spend_key_time ON chat_pipeline_spend (key_id, time_us);
