-- Virtual keys (pipeline.keys): one row per key, its fields as JSON in `body`, its secrets'
-- SHA-256 digests (each with the time it stops working, after a rotation) as JSON in
-- `secrets`. `version` is the number of the change that last wrote the row, taken from
-- chat_pipeline_key_changes in the change's own transaction, so changes commit in the
-- order of their numbers and a replica reads the changes after the last one it saw.
CREATE TABLE chat_pipeline_key_changes (
    id INTEGER PRIMARY KEY,
    last BIGINT NOT NULL
);
INSERT INTO chat_pipeline_key_changes (id, last) VALUES (1, 0);
CREATE TABLE chat_pipeline_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    secrets TEXT NOT NULL,
    version BIGINT NOT NULL
);
CREATE INDEX chat_pipeline_keys_version ON chat_pipeline_keys (version);
