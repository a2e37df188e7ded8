-- tracedb storage, schema version 7 (tracedb/migrations.py upgrades older files).
-- One row per episode, trace, node, branch; token ids live once per distinct content
-- in `segments`. Columns that hold a record's fields keep them exactly: `record` holds
-- the JSON of everything that has no column of its own.
--
-- Per-token arrays are kept as text, one character per value (tracedb/codec: token ids
-- and fixed-point streams), so that DuckDB compresses them with zstd; so are the JSON
-- records and message text. `node_store` and `segment_store` hold them so; the views
-- `nodes` and `segments` (schema/encoded.sql) show them decoded, as lists, to any client.
-- Only the tables a lookup needs by key keep a primary key (an ART index costs ~60-80
-- bytes a key): traces, episodes and the small tables. Nodes and branches are written
-- once per fresh trace (unique by construction), segments are looked up by a join.

CREATE TABLE IF NOT EXISTS tracedb_meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR
);

CREATE TABLE IF NOT EXISTS episodes (
    episode_id  VARCHAR PRIMARY KEY,
    group_id    VARCHAR,           -- episode.group.id
    env_id      VARCHAR,           -- episode.env.id
    ok          BOOLEAN,
    record      JSON NOT NULL USING COMPRESSION zstd,  -- the episode without its traces
    source      VARCHAR,           -- file it was ingested from
    line        BIGINT,
    ingested_at TIMESTAMP DEFAULT current_timestamp,
    -- episode.run (verifiers): the work it was dispatched as ('train' or 'eval'; a run of
    -- type 'eval' without work is 'eval'), the training step, the live policy span.
    work_type    VARCHAR,
    work_step    BIGINT,
    policy_start BIGINT,
    policy_end   BIGINT
);

CREATE TABLE IF NOT EXISTS traces (
    trace_id       VARCHAR PRIMARY KEY,
    episode_id     VARCHAR,        -- NULL for a trace ingested on its own
    position       INTEGER,        -- index in episode.traces
    group_id       VARCHAR,
    reward         DOUBLE,         -- weighted sum of scored rewards; NULL when none scored
    ok             BOOLEAN,
    is_completed   BOOLEAN,
    is_timeout     BOOLEAN,
    stop_condition VARCHAR,
    n_nodes        INTEGER,
    n_branches     INTEGER,
    n_tokens       BIGINT,         -- tokens over all nodes (each node once)
    n_sampled      BIGINT,         -- sampled tokens over all nodes
    record         JSON NOT NULL USING COMPRESSION zstd,  -- the trace without its nodes
    source         VARCHAR,
    line           BIGINT,
    ingested_at    TIMESTAMP DEFAULT current_timestamp,
    seq            BIGINT,         -- ingest sequence number: 1, 2, ... in commit order (the watermark)
    dropped        VARCHAR,        -- why consumers leave the trace out (verifiers 0.4.1); NULL: kept
    -- Policy versions of the sampled tokens (tracedb/policy.py's rule): the lowest and
    -- highest known, and how many sampled tokens have none (a label not mapped, no span
    -- and no episode policy). Recomputed when a label is mapped (policy_labels).
    policy_min     BIGINT,
    policy_max     BIGINT,
    policy_unknown BIGINT,
    work_type      VARCHAR         -- its episode's work_type, kept here so selections and credit need no join
);

-- Weight labels mapped to policy versions (db.set_policy_versions): a label matching
-- ^(step|v|version)?[_-]?(\d+)$ names its number itself and needs no row.
CREATE TABLE IF NOT EXISTS policy_labels (
    label   VARCHAR PRIMARY KEY,
    version BIGINT NOT NULL,
    set_at  TIMESTAMP DEFAULT current_timestamp
);

-- Typed tags on traces (`tracedb ingest --tag name=value` or `name=$.json.path`): one row
-- per trace and name; numbers compare as numbers (`number`), strings as strings (`text`).
CREATE TABLE IF NOT EXISTS trace_tags (
    trace_id VARCHAR NOT NULL,
    name     VARCHAR NOT NULL,
    value    JSON NOT NULL,        -- the tag's value as JSON
    number   DOUBLE,               -- the value when it is a number
    text     VARCHAR               -- the value when it is a string
);

-- Where `tracedb ingest --follow` is in each file it follows, committed with the lines
-- read up to there (so a restart continues exactly where the last commit ended). The
-- file is known by its identity (device, inode) and by hashes of the bytes it was read
-- from (docs/live.md: what a truncation or a rotation can and cannot lose).
CREATE TABLE IF NOT EXISTS follow_positions (
    path         VARCHAR PRIMARY KEY, -- the file, absolute (where it is now)
    device       BIGINT,
    inode        BIGINT,
    "offset"     BIGINT NOT NULL,    -- bytes consumed: the end of the last whole line read
    line         BIGINT NOT NULL,    -- lines consumed
    head         BLOB,               -- BLAKE2b of the first bytes consumed (up to 4 KiB): a rewrite changes it
    updated_at   TIMESTAMP DEFAULT current_timestamp,
    tail         BLOB,               -- BLAKE2b of the bytes just before "offset" (up to 4 KiB): a regrow past it changes it (schema 5)
    rotated_from VARCHAR             -- a rotated file still read by its identity: the followed path it was renamed away from (schema 5)
);

-- Token ids stored once per distinct content (system prompts, task prompts). A row holds
-- them as a list or as text: an ingest batch keeps the smaller (tracedb.codec.token_form:
-- real text under a BPE vocabulary compresses 4-5x as text; uniform ids pack better).
CREATE TABLE IF NOT EXISTS segment_store (
    segment_id BLOB NOT NULL,      -- 128-bit BLAKE2b of the int32 token ids
    n_tokens   INTEGER NOT NULL,
    token_ids  INTEGER[],          -- the ids, when kept as a list (else NULL)
    tokens     VARCHAR USING COMPRESSION zstd  -- the ids as text, one character each (else NULL)
);

-- One row per node. The compact streams and each list of loss_weights are stream text
-- (tracedb.codec: fixed point when the values are m / 10^d, as verifiers writes them, else
-- their shortest decimals); NULL = the record holds none.
CREATE TABLE IF NOT EXISTS node_store (
    trace_id           VARCHAR NOT NULL,
    node_index         INTEGER NOT NULL,
    parent             INTEGER,
    role               VARCHAR,    -- message.role, for queries
    sampled            BOOLEAN,
    "timestamp"        DOUBLE,
    segment_id         BLOB NOT NULL,
    n_tokens           INTEGER NOT NULL,
    n_sampled          INTEGER NOT NULL,
    -- The mask: canonical (mask_prefix unsampled tokens, then the rest sampled) or, when
    -- not canonical, mask_slots: 0 on unsampled tokens, k on the k-th sampled token.
    mask_prefix        INTEGER,
    mask_slots         INTEGER[],
    is_content         BOOLEAN[],
    logprobs           VARCHAR USING COMPRESSION zstd,
    advantages         VARCHAR USING COMPRESSION zstd,  -- NULL = never assigned; an empty or zero list is not NULL
    reference_logprobs VARCHAR USING COMPRESSION zstd,
    trainer_logprobs   VARCHAR USING COMPRESSION zstd,
    entropies          VARCHAR USING COMPRESSION zstd,
    loss_weights       VARCHAR USING COMPRESSION zstd,  -- JSON: each name's stream text, in the record's order
    semantic_parents   STRUCT("node" INTEGER, "type" VARCHAR)[],
    semantic_parents_record JSON,  -- the links as written, only when they carry more than node and type
    message            JSON USING COMPRESSION zstd,
    extra              JSON,       -- node fields tracedb has no column for
    present            INTEGER NOT NULL,  -- bit i: field i of records.NODE_KEYS was in the record
    -- verifiers 0.4.1: sampled tokens [start, end) (among the node's sampled tokens) came
    -- from the engine weights labelled version; NULL when the record holds none.
    weight_versions    STRUCT("version" VARCHAR, "start" INTEGER, "end" INTEGER)[],
    -- A batch's streams kept as lists instead, where their text would not be clearly
    -- smaller (tracedb.codec.stream_form: lists read faster); the text column is then NULL.
    logprobs_list           FLOAT[],
    advantages_list         FLOAT[],
    reference_logprobs_list FLOAT[],
    trainer_logprobs_list   FLOAT[],
    entropies_list          FLOAT[]
);

CREATE TABLE IF NOT EXISTS branches (
    trace_id     VARCHAR NOT NULL,
    branch_index INTEGER NOT NULL,  -- verifiers' Branch.index
    leaf         INTEGER NOT NULL,
    trainable    BOOLEAN NOT NULL,
    path         INTEGER[] NOT NULL, -- node indices, root first
    n_tokens     BIGINT NOT NULL,
    n_sampled    BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS rejects (
    source      VARCHAR,
    line        BIGINT,
    trace_id    VARCHAR,
    node        INTEGER,
    field       VARCHAR,
    reason      VARCHAR NOT NULL,
    record      VARCHAR USING COMPRESSION zstd,  -- the rejected line as it was (its first bytes when it is long)
    rejected_at TIMESTAMP DEFAULT current_timestamp,
    record_bytes  BIGINT,          -- the length of the whole line, in bytes
    record_sha256 VARCHAR          -- the SHA-256 of the whole line, hex
);

-- Named credit sets: many assignments side by side on the same frozen rollouts. The
-- set called 'default' is the credit ingested with the records (nodes.advantages).
-- A set is stored one way only: per trace ('trace', rows in trace_credit) or per node
-- ('node', rows in credit); the writers refuse the other shape.
CREATE TABLE IF NOT EXISTS credit_sets (
    name        VARCHAR PRIMARY KEY,
    algorithm   VARCHAR NOT NULL,
    params      JSON,
    description VARCHAR,
    created_at  TIMESTAMP DEFAULT current_timestamp,
    layout      VARCHAR NOT NULL DEFAULT 'node'  -- 'trace' or 'node'
);

-- One row per assigned node of a per-node set; no row = never assigned (None, not zero).
-- A constant over the node's sampled tokens is stored once in `value`; otherwise the
-- compact list is in `advantages`. (credit_set, trace_id, node_index) is unique: the
-- write path (tracedb/writeback.py) deletes before it inserts distinct rows, so the
-- table carries no index to maintain on every stamp.
CREATE TABLE IF NOT EXISTS credit (
    credit_set VARCHAR NOT NULL,
    trace_id   VARCHAR NOT NULL,
    node_index INTEGER NOT NULL,
    value      FLOAT,
    advantages FLOAT[]
);

-- One row per assigned trace of a per-trace set (grpo, rloo): its value on every sampled
-- token of the trace. Nodes without sampled tokens stay unassigned, and a trace without a
-- row is unassigned (None, not zero). (credit_set, trace_id) is unique, as in credit.
CREATE TABLE IF NOT EXISTS trace_credit (
    credit_set VARCHAR NOT NULL,
    trace_id   VARCHAR NOT NULL,
    value      FLOAT NOT NULL
);
