-- Counterfactual edit credit (tracedb.cec), schema cec/1. Installed on first use
-- by tracedb.cec (idempotent). Harness records: per trace, per assistant turn,
-- per verification; and the plan computed from them (one row per trace).

-- Per trace: the task's baseline tree and the selection key instance_id|rep|cache_salt.
CREATE TABLE IF NOT EXISTS cec_traces (
    trace_id      VARCHAR PRIMARY KEY,
    baseline_tree VARCHAR NOT NULL,   -- opaque tree id (git: the tree before generation)
    instance_id   VARCHAR NOT NULL,
    rep           VARCHAR NOT NULL,   -- as it enters the key: an integer rep in decimal
    cache_salt    VARCHAR NOT NULL,
    info          JSON,
    record        JSON NOT NULL,      -- the validated record, as ingested
    source        VARCHAR,
    line          BIGINT,
    ingested_at   TIMESTAMP DEFAULT current_timestamp
);

-- Per assistant turn (a sampled assistant node): the tree after its actions finished,
-- the paths changed since the previous tree, and whether it was a format error.
CREATE TABLE IF NOT EXISTS cec_turns (
    trace_id      VARCHAR NOT NULL,
    node_index    INTEGER NOT NULL,
    tree          VARCHAR NOT NULL,
    changed_paths VARCHAR[] NOT NULL,
    format_error  BOOLEAN NOT NULL,
    info          JSON,
    record        JSON NOT NULL,
    source        VARCHAR,
    line          BIGINT,
    ingested_at   TIMESTAMP DEFAULT current_timestamp,
    PRIMARY KEY (trace_id, node_index)
);

-- Per verification of the original artifact or of the intervention: the resolved
-- verdict and the fixed, deduplicated expected test lists with each test's outcome
-- (NULL: the test is absent from the report), or a missing / unparseable report.
CREATE TABLE IF NOT EXISTS cec_verifications (
    trace_id    VARCHAR NOT NULL,
    role        VARCHAR NOT NULL CHECK (role IN ('original', 'intervention')),
    status      VARCHAR NOT NULL CHECK (status IN ('ok', 'missing', 'unparseable')),
    resolved    BOOLEAN,
    f2p         MAP(VARCHAR, VARCHAR),
    p2p         MAP(VARCHAR, VARCHAR),
    info        JSON,
    record      JSON NOT NULL,
    source      VARCHAR,
    line        BIGINT,
    ingested_at TIMESTAMP DEFAULT current_timestamp,
    PRIMARY KEY (trace_id, role)
);

-- The plan: one row per trace of the database, rewritten whole by cec.plan / cec.stamp.
CREATE TABLE IF NOT EXISTS cec_selection (
    trace_id         VARCHAR PRIMARY KEY,
    group_key        VARCHAR,          -- the group the terminal advantage is centred in
    reward           DOUBLE,
    valid            BOOLEAN NOT NULL, -- a valid group member (else A = 0 and no auxiliary term)
    advantage        DOUBLE NOT NULL,  -- A: r - mean(valid members' r), 0 when excluded
    format_error     BOOLEAN NOT NULL, -- any turn was a format error
    n_turns          INTEGER NOT NULL, -- turn records (snapshots)
    blocks           JSON,             -- [{index, nodes, pre_tree, post_tree, paths, eligible, reasons}]
    eligible         INTEGER[],
    selected         INTEGER,          -- the selected block's index, NULL when unavailable
    selection        VARCHAR NOT NULL, -- 'selected' or why not (see docs/cec.md)
    selection_detail VARCHAR,
    selected_nodes   INTEGER[],        -- the producing turns of the selected block
    touched_paths    VARCHAR[],
    baseline_tree    VARCHAR,
    pre_block_tree   VARCHAR,
    final_tree       VARCHAR,
    generated_tokens BIGINT NOT NULL,  -- L: sampled tokens of the trace (each node once)
    edit_tokens      BIGINT,           -- m: sampled tokens of the selected block's turns
    query            VARCHAR NOT NULL, -- 'planned' or why no counterfactual query
    intervention     VARCHAR,          -- 'usable', 'pending', 'missing', 'unparseable', 'lists_differ', 'unplanned'
    y_orig DOUBLE, f_orig DOUBLE, g_orig DOUBLE, u_orig DOUBLE,
    y_int  DOUBLE, f_int  DOUBLE, g_int  DOUBLE, u_int  DOUBLE,
    d DOUBLE, d_y DOUBLE, d_f DOUBLE, d_g DOUBLE,
    s      DOUBLE,                     -- shared shrinkage (usable contrasts)
    coef_m DOUBLE,                     -- M's per-token coefficient on its receiving tokens
    coef_b DOUBLE,                     -- B's per-token coefficient on every sampled token
    coef_e DOUBLE,                     -- E's per-token coefficient on its receiving tokens
    credit_m DOUBLE NOT NULL,          -- what was added: coef_* when the trace receives it, else 0
    credit_b DOUBLE NOT NULL,
    credit_e DOUBLE NOT NULL,
    lam DOUBLE NOT NULL,
    cap DOUBLE NOT NULL,
    planned_at TIMESTAMP DEFAULT current_timestamp
);
