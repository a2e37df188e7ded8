-- tracedb SQL macros, installed into every database file so that any DuckDB client
-- can use them. They follow the spreading rule of verifiers' Branch.spread exactly.

-- A node's sampled mask, per token.
CREATE OR REPLACE MACRO tdb_mask(n_tokens, mask_prefix, mask_slots) AS
    CASE WHEN mask_slots IS NULL
         THEN list_concat(list_resize([]::BOOLEAN[], mask_prefix, false),
                          list_resize([]::BOOLEAN[], n_tokens - mask_prefix, true))
         ELSE list_transform(mask_slots, lambda k: k > 0)
    END;

-- A compact per-sampled-token stream widened onto the node's tokens: values land on the
-- sampled positions in order, 0.0 elsewhere; extra values are dropped, missing read 0.0,
-- NULL or empty contributes zeros.
CREATE OR REPLACE MACRO tdb_widen(vals, n_tokens, n_sampled, mask_prefix, mask_slots) AS
    CASE WHEN mask_slots IS NULL
         THEN list_concat(list_resize([]::FLOAT[], mask_prefix, 0.0::FLOAT),
                          list_resize(coalesce(vals, []::FLOAT[]), n_sampled, 0.0::FLOAT))
         ELSE list_transform(mask_slots,
                             lambda k: CASE WHEN k = 0 THEN 0.0::FLOAT
                                       ELSE coalesce(vals[k], 0.0::FLOAT) END)
    END;

-- Each node's compact advantages in one credit set: 'default' (or NULL) is the credit
-- ingested with the records; a named set reads the credit table (stored per node) or the
-- trace_credit table (stored per trace: the trace's value on each node with sampled
-- tokens). A node without a row is unassigned (NULL); a constant is stored once and
-- broadcast here.
CREATE OR REPLACE MACRO credit_advantages(credit_set) AS TABLE
    SELECT n.trace_id, n.node_index, n.n_sampled,
           CASE WHEN credit_set IS NULL OR credit_set = 'default' THEN n.advantages
                ELSE coalesce(c.advantages,
                              CASE WHEN coalesce(c.value, t.value) IS NOT NULL
                                   THEN list_resize([]::FLOAT[], n.n_sampled, coalesce(c.value, t.value)) END)
           END AS advantages
    FROM nodes n
    LEFT JOIN credit c
           ON c.credit_set = credit_set AND c.trace_id = n.trace_id AND c.node_index = n.node_index
    LEFT JOIN trace_credit t
           ON t.credit_set = credit_set AND t.trace_id = n.trace_id AND n.n_sampled > 0;

-- A weight label's own policy version (tracedb/policy.py's rule): step_12, v3, 12,
-- version-7 (any case) name their number; any other label none (NULL) until mapped.
CREATE OR REPLACE MACRO tdb_label_number(label) AS
    TRY_CAST(nullif(regexp_extract(label, '^(?:step|v|version)?[_-]?([0-9]+)$', 1, 'i'), '') AS INTEGER);

-- An integer compact stream widened onto the node's tokens: values on the sampled
-- positions in order, NULL elsewhere.
CREATE OR REPLACE MACRO tdb_widen_int(vals, n_tokens, mask_prefix, mask_slots) AS
    CASE WHEN mask_slots IS NULL
         THEN list_concat(list_resize([]::INTEGER[], mask_prefix), vals)
         ELSE list_transform(mask_slots, lambda k: CASE WHEN k = 0 THEN NULL::INTEGER ELSE vals[k] END)
    END;

-- Each node's sampled tokens' policy versions (compact): a token a span covers has its
-- label's number (its own, else policy_labels'; NULL when neither), any other sampled
-- token its episode's policy start, else its step.
CREATE OR REPLACE MACRO node_policy_versions() AS TABLE
    WITH spans AS (
        SELECT n.trace_id, n.node_index,
               list({'start': s.start, 'end': s."end",
                     'v': coalesce(tdb_label_number(s.version), TRY_CAST(m.version AS INTEGER))}) AS sv
        FROM nodes n, unnest(n.weight_versions) AS u(s)
        LEFT JOIN policy_labels m ON m.label = s.version
        WHERE n.weight_versions IS NOT NULL
        GROUP BY ALL
    )
    SELECT n.trace_id, n.node_index,
           list_transform(range(n.n_sampled), lambda k:
               CASE WHEN len(list_filter(coalesce(sp.sv, []), lambda s: s.start <= k AND k < s."end")) > 0
                    THEN list_filter(sp.sv, lambda s: s.start <= k AND k < s."end")[1].v
                    ELSE TRY_CAST(coalesce(e.policy_start, e.work_step) AS INTEGER) END) AS versions
    FROM nodes n
    LEFT JOIN spans sp USING (trace_id, node_index)
    LEFT JOIN traces t USING (trace_id)
    LEFT JOIN episodes e ON e.episode_id = t.episode_id;

-- One row per node with its tokens and every stream in full (per-token) layout.
CREATE OR REPLACE MACRO node_tokens(credit := NULL) AS TABLE
    SELECT n.trace_id, n.node_index, n.parent, n.role, n.sampled,
           n.n_tokens, n.n_sampled,
           s.token_ids,
           tdb_mask(n.n_tokens, n.mask_prefix, n.mask_slots) AS sampled_mask,
           tdb_widen(n.logprobs, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots) AS logprobs,
           a.advantages IS NOT NULL AS has_advantages,
           tdb_widen(a.advantages, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots) AS advantages,
           n.reference_logprobs IS NOT NULL AS has_reference_logprobs,
           tdb_widen(n.reference_logprobs, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots) AS reference_logprobs,
           n.trainer_logprobs IS NOT NULL AS has_trainer_logprobs,
           tdb_widen(n.trainer_logprobs, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots) AS trainer_logprobs,
           n.entropies IS NOT NULL AS has_entropies,
           tdb_widen(n.entropies, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots) AS entropies,
           n.loss_weights,
           tdb_widen_int(pv.versions, n.n_tokens, n.mask_prefix, n.mask_slots) AS policy_version
    FROM nodes n JOIN segments s USING (segment_id)
    JOIN credit_advantages(credit) a USING (trace_id, node_index)
    JOIN node_policy_versions() pv USING (trace_id, node_index);

-- One row per (branch, node on its path), pos = 1 at the root. first_branch is the
-- first trainable branch holding the node (or the first branch, if none is trainable).
CREATE OR REPLACE MACRO branch_nodes() AS TABLE
    WITH p AS (
        SELECT trace_id, branch_index, trainable,
               unnest(path) AS node_index, generate_subscripts(path, 1) AS pos
        FROM branches
    )
    SELECT p.*,
           min(branch_index) FILTER (WHERE trainable)
               OVER (PARTITION BY trace_id, node_index) AS first_trainable,
           min(branch_index) OVER (PARTITION BY trace_id, node_index) AS first_any,
           coalesce(first_trainable, first_any) AS first_branch
    FROM p;

-- The branch-spread token view: one row per branch, aligned per-token arrays.
-- A stream is NULL when no node on the path holds it; loss_weights maps each name that
-- some node on the path holds to its spread (zeros on nodes lacking it).
-- train_once: a node's sampled tokens stay in the mask only in its first branch.
CREATE OR REPLACE MACRO branch_tokens(train_once := false, credit := NULL) AS TABLE
    WITH bn AS (
        SELECT b.trace_id, b.branch_index, b.trainable, b.pos, t.*
               EXCLUDE (trace_id, node_index),
               CASE WHEN train_once AND b.first_branch <> b.branch_index
                    THEN list_resize([]::BOOLEAN[], t.n_tokens, false)
                    ELSE t.sampled_mask END AS mask_used
        FROM branch_nodes() b
        JOIN node_tokens(credit := credit) t USING (trace_id, node_index)
    ),
    names AS (
        SELECT DISTINCT trace_id, branch_index, unnest(map_keys(loss_weights)) AS name
        FROM bn WHERE loss_weights IS NOT NULL
    ),
    lw AS (
        SELECT trace_id, branch_index,
               map_from_entries(list({'key': name, 'value': weights} ORDER BY name)) AS loss_weights
        FROM (
            SELECT bn.trace_id, bn.branch_index, names.name,
                   flatten(list(coalesce(element_at(bn.loss_weights, names.name)[1],
                                         list_resize([]::FLOAT[], bn.n_tokens, 0.0::FLOAT))
                                ORDER BY bn.pos)) AS weights
            FROM bn JOIN names USING (trace_id, branch_index)
            GROUP BY ALL
        )
        GROUP BY ALL
    ),
    spread AS (
        SELECT trace_id, branch_index, any_value(trainable) AS trainable,
               flatten(list(token_ids ORDER BY pos)) AS token_ids,
               flatten(list(mask_used ORDER BY pos)) AS sampled_mask,
               flatten(list(logprobs ORDER BY pos)) AS logprobs,
               CASE WHEN bool_or(has_advantages)
                    THEN flatten(list(advantages ORDER BY pos)) END AS advantages,
               CASE WHEN bool_or(has_reference_logprobs)
                    THEN flatten(list(reference_logprobs ORDER BY pos)) END AS reference_logprobs,
               CASE WHEN bool_or(has_trainer_logprobs)
                    THEN flatten(list(trainer_logprobs ORDER BY pos)) END AS trainer_logprobs,
               CASE WHEN bool_or(has_entropies)
                    THEN flatten(list(entropies ORDER BY pos)) END AS entropies,
               CASE WHEN bool_or(list_count(policy_version) > 0)
                    THEN flatten(list(policy_version ORDER BY pos)) END AS policy_version
        FROM bn
        GROUP BY trace_id, branch_index
    )
    SELECT s.trace_id, s.branch_index, s.trainable, s.token_ids, s.sampled_mask, s.logprobs,
           s.advantages, s.reference_logprobs, s.trainer_logprobs, s.entropies,
           coalesce(lw.loss_weights, MAP {}::MAP(VARCHAR, FLOAT[])) AS loss_weights, s.policy_version
    FROM spread s LEFT JOIN lw USING (trace_id, branch_index)
    ORDER BY s.trace_id, s.branch_index;

-- Per-branch sizes for analysts: tokens, sampled tokens, their share, credit presence.
CREATE OR REPLACE MACRO branch_stats() AS TABLE
    SELECT b.trace_id, b.branch_index, b.trainable, b.n_tokens, b.n_sampled,
           CASE WHEN b.n_tokens > 0 THEN b.n_sampled / b.n_tokens END AS sampled_share,
           b.n_nodes,
           count(n.advantages) AS credited_nodes,
           count(*) FILTER (WHERE n.sampled) AS sampled_nodes
    -- The path unnested in a select list, not laterally: a filter on the trace id (or the
    -- branch) then reaches the scans of branches and nodes (a lake reads only its traces).
    FROM (SELECT trace_id, branch_index, trainable, n_tokens, n_sampled, len(path) AS n_nodes,
                 unnest(path) AS node_index
          FROM branches) b
    JOIN nodes n ON n.trace_id = b.trace_id AND n.node_index = b.node_index
    GROUP BY ALL;

-- Which nodes carry credit in a set, and how much (NULL = never assigned, not zero).
CREATE OR REPLACE MACRO node_credit(credit := NULL) AS TABLE
    SELECT n.trace_id, n.node_index, n.role, n.sampled, n.n_sampled,
           a.advantages IS NOT NULL AS assigned,
           list_sum(a.advantages) AS advantage_sum,
           list_avg(a.advantages) AS advantage_mean,
           list_sum(list_transform(a.advantages, lambda x: abs(x))) AS advantage_abs_sum
    FROM nodes n JOIN credit_advantages(credit) a USING (trace_id, node_index);

-- Each node's credit in one set as the spread reads it: its sampled tokens' values (a
-- compact list cut or zero-padded to the node's sampled tokens), NULL when unassigned.
CREATE OR REPLACE MACRO credit_tokens(credit := NULL) AS TABLE
    SELECT trace_id, node_index, n_sampled,
           CASE WHEN advantages IS NOT NULL
                THEN list_transform(list_resize(advantages, n_sampled, 0.0::FLOAT), lambda x: x::DOUBLE) END AS a
    FROM credit_advantages(credit);

-- Each node's absolute credit mass in one set, as credit_tokens spreads it (a compact
-- list cut or zero-padded to the node's sampled tokens, a per-node or per-trace value on
-- each of them), without building per-token lists for values: abs_sum (sum of |A| over
-- its sampled tokens, DOUBLE) and n_sampled (the tokens assigned). Assigned nodes only.
-- Replay ranks earlier groups by it (tracedb/batches/replay.py).
CREATE OR REPLACE MACRO credit_abs_mass(credit := NULL) AS TABLE
    WITH per AS (
        SELECT n.trace_id, n.node_index, n.n_sampled,
               CASE WHEN credit IS NULL OR credit = 'default' THEN n.advantages ELSE c.advantages END AS listed,
               CASE WHEN credit IS NULL OR credit = 'default' THEN NULL
                    ELSE coalesce(c.value, t.value)::FLOAT END AS scalar
        FROM nodes n
        LEFT JOIN credit c
               ON c.credit_set = credit AND c.trace_id = n.trace_id AND c.node_index = n.node_index
        LEFT JOIN trace_credit t
               ON t.credit_set = credit AND t.trace_id = n.trace_id AND n.n_sampled > 0
    )
    SELECT trace_id, node_index, n_sampled,
           CASE WHEN listed IS NOT NULL
                THEN coalesce(list_sum(list_transform(listed[1:n_sampled], lambda x: abs(x::DOUBLE))), 0.0)
                ELSE abs(scalar::DOUBLE) * n_sampled END AS abs_sum
    FROM per
    WHERE listed IS NOT NULL OR scalar IS NOT NULL;

-- The dose of one credit set, per trace, over the trace's sampled tokens (each node once):
-- tokens assigned and credited (nonzero), coverage (assigned / sampled), signed, absolute
-- and squared mass, and concentration n * sum(A^2) / sum(|A|)^2 over the trace's n sampled
-- tokens (1 for uniform credit, L/m for equal credit on m of L tokens). The masses and the
-- concentration are NULL for a trace the set leaves unassigned (None is not zero).
CREATE OR REPLACE MACRO credit_dose(credit := NULL) AS TABLE
    WITH per AS (
        SELECT trace_id,
               count(a) AS assigned_nodes,
               coalesce(sum(len(a)), 0)::BIGINT AS assigned_tokens,  -- a holds n_sampled values
               coalesce(sum(len(list_filter(a, lambda x: x <> 0))), 0)::BIGINT AS credited_tokens,
               sum(coalesce(list_sum(a), 0.0)) FILTER (WHERE a IS NOT NULL) AS mass,
               sum(coalesce(list_sum(list_transform(a, lambda x: abs(x))), 0.0))
                   FILTER (WHERE a IS NOT NULL) AS abs_mass,
               sum(coalesce(list_sum(list_transform(a, lambda x: x * x)), 0.0))
                   FILTER (WHERE a IS NOT NULL) AS sq_mass
        FROM credit_tokens(credit := credit) GROUP BY trace_id
    )
    SELECT t.trace_id, t.group_id, t.reward, t.n_sampled AS sampled_tokens,
           coalesce(p.assigned_nodes, 0) AS assigned_nodes,
           coalesce(p.assigned_tokens, 0) AS assigned_tokens,
           coalesce(p.credited_tokens, 0) AS credited_tokens,
           CASE WHEN t.n_sampled > 0 THEN coalesce(p.assigned_tokens, 0) / t.n_sampled END AS coverage,
           p.mass, p.abs_mass, p.sq_mass,
           CASE WHEN p.abs_mass > 0 THEN t.n_sampled * p.sq_mass / (p.abs_mass * p.abs_mass) END AS concentration
    FROM traces t LEFT JOIN per p USING (trace_id)
    ORDER BY t.trace_id;

-- Two credit sets token by token, per trace, over the sampled tokens both assign: how many,
-- the share whose signs agree (sign -1, 0 or 1), and the Pearson correlation of the two
-- (NULL under two tokens or when either set is constant over them, as grpo is in a trace).
-- per_trace := false: one row (trace_id NULL) over every token both assign. trace_ids (a
-- list, NULL: every trace): only those traces' tokens.
CREATE OR REPLACE MACRO credit_agreement(set_a, set_b, per_trace := true, trace_ids := NULL) AS TABLE
    WITH both_sets AS (
        SELECT x.trace_id, x.a, y.a AS b
        FROM credit_tokens(credit := set_a) x JOIN credit_tokens(credit := set_b) y USING (trace_id, node_index)
        WHERE x.a IS NOT NULL AND y.a IS NOT NULL AND x.n_sampled > 0
          AND (trace_ids IS NULL OR list_contains(trace_ids, x.trace_id))
    ),
    tokens AS (SELECT trace_id, unnest(a) AS x, unnest(b) AS y FROM both_sets)
    SELECT CASE WHEN per_trace THEN trace_id END AS trace_id, count(*) AS shared_tokens,
           avg(CASE WHEN sign(x) = sign(y) THEN 1.0 ELSE 0.0 END) AS sign_agreement,
           CASE WHEN count(*) > 1 AND var_pop(x) > 0 AND var_pop(y) > 0 THEN corr(x, y) END AS correlation
    FROM tokens GROUP BY ALL;

-- Two credit sets on the same rollouts, per trace: each one's dose (credit_dose: *_a, *_b)
-- and, between them, the tokens both assign, their sign agreement and correlation
-- (credit_agreement; NULL where they share no token).
CREATE OR REPLACE MACRO credit_compare(set_a, set_b) AS TABLE
    SELECT t.trace_id, t.group_id, t.reward,
           a.mass AS mass_a, b.mass AS mass_b, a.abs_mass AS abs_mass_a, b.abs_mass AS abs_mass_b,
           a.assigned_nodes AS assigned_nodes_a, b.assigned_nodes AS assigned_nodes_b,
           t.n_sampled AS sampled_tokens,
           a.assigned_tokens AS assigned_tokens_a, b.assigned_tokens AS assigned_tokens_b,
           a.credited_tokens AS credited_tokens_a, b.credited_tokens AS credited_tokens_b,
           a.coverage AS coverage_a, b.coverage AS coverage_b,
           a.sq_mass AS sq_mass_a, b.sq_mass AS sq_mass_b,
           a.concentration AS concentration_a, b.concentration AS concentration_b,
           coalesce(g.shared_tokens, 0) AS shared_tokens, g.sign_agreement, g.correlation
    FROM traces t
    JOIN credit_dose(credit := set_a) a USING (trace_id)
    JOIN credit_dose(credit := set_b) b USING (trace_id)
    LEFT JOIN credit_agreement(set_a, set_b) g USING (trace_id)
    ORDER BY t.trace_id;

-- One row per trace with its group, reward and sizes; the starting point of most queries.
CREATE OR REPLACE MACRO trace_summary() AS TABLE
    SELECT t.trace_id, t.episode_id, t.group_id, t.reward, t.ok, t.stop_condition,
           t.n_nodes, t.n_branches, t.n_tokens, t.n_sampled,
           (SELECT count(*) FROM nodes n WHERE n.trace_id = t.trace_id AND n.advantages IS NOT NULL)
               AS credited_nodes  -- in the default (ingested) set
    FROM traces t;

-- The credit status of a trace or a branch in one set, from its nodes: 'unassigned' (no
-- node holds advantages: None, never scored), 'zero' (assigned, every value 0: scored, no
-- gradient), 'partial' (some nodes with sampled tokens are unassigned) or 'assigned'.
-- The one rule every page, route and command reports credit status by.
CREATE OR REPLACE MACRO tdb_credit_status(assigned_nodes, sampled_nodes, assigned_sampled, abs_mass) AS
    CASE WHEN assigned_nodes = 0 THEN 'unassigned'
         WHEN coalesce(abs_mass, 0) = 0 THEN 'zero'
         WHEN assigned_sampled < sampled_nodes THEN 'partial'
         ELSE 'assigned'
    END;

-- Per trace, its credit in one set: nodes assigned, nodes with sampled tokens, those of
-- them assigned, the absolute mass, and the status (tdb_credit_status).
CREATE OR REPLACE MACRO trace_credit_status(credit := NULL) AS TABLE
    SELECT trace_id, assigned_nodes, sampled_nodes, assigned_sampled, abs_mass,
           tdb_credit_status(assigned_nodes, sampled_nodes, assigned_sampled, abs_mass) AS credit_status
    FROM (SELECT a.trace_id, count(a.advantages) AS assigned_nodes,
                 count(*) FILTER (WHERE a.n_sampled > 0) AS sampled_nodes,
                 count(*) FILTER (WHERE a.n_sampled > 0 AND a.advantages IS NOT NULL) AS assigned_sampled,
                 coalesce(sum(list_sum(list_transform(a.advantages, lambda v: abs(v)))), 0) AS abs_mass
          FROM credit_advantages(credit) a GROUP BY a.trace_id);

-- Per branch, its credit in one set over the nodes of its path (as trace_credit_status).
CREATE OR REPLACE MACRO branch_credit_status(credit := NULL) AS TABLE
    SELECT trace_id, branch_index, assigned_nodes, sampled_nodes, assigned_sampled, abs_mass,
           tdb_credit_status(assigned_nodes, sampled_nodes, assigned_sampled, abs_mass) AS credit_status
    FROM (SELECT b.trace_id, b.branch_index, count(a.advantages) AS assigned_nodes,
                 count(*) FILTER (WHERE a.n_sampled > 0) AS sampled_nodes,
                 count(*) FILTER (WHERE a.n_sampled > 0 AND a.advantages IS NOT NULL) AS assigned_sampled,
                 coalesce(sum(list_sum(list_transform(a.advantages, lambda v: abs(v)))), 0) AS abs_mass
          FROM branches b, unnest(b.path) AS u(node_index)
          JOIN credit_advantages(credit) a ON a.trace_id = b.trace_id AND a.node_index = u.node_index
          GROUP BY b.trace_id, b.branch_index);

-- A group is zero-variance when it has scored members and all of them hold the same
-- reward (one scored member included): a group-relative advantage is then zero on every
-- member, so the group carries no gradient. Unscored members (reward NULL) are left out,
-- as a trainer drops them. Arguments: the count, min and max of the members' rewards.
CREATE OR REPLACE MACRO tdb_zero_variance(scored, lo, hi) AS scored >= 1 AND lo = hi;

-- Per group (traces sharing a group id), as of the watermark `through` (NULL: all): its
-- members, scored members, reward mean, spread, extremes, whether it is zero-variance,
-- and the sequence number of its newest member.
CREATE OR REPLACE MACRO group_rewards(through := NULL) AS TABLE
    SELECT group_id, count(*) AS traces, count(reward) AS scored, avg(reward) AS reward_mean,
           stddev_pop(reward) AS reward_std, min(reward) AS reward_min, max(reward) AS reward_max,
           tdb_zero_variance(count(reward), min(reward), max(reward)) AS zero_variance,
           max(seq) AS last_seq
    FROM traces WHERE group_id IS NOT NULL AND (through IS NULL OR seq <= through)
    GROUP BY group_id;

-- Off-policy mismatch between the policy that sampled a token (the node's `logprobs`, the
-- inference engine's) and the trainer's policy (`trainer_logprobs`, written back by a
-- recompute pass). A token holds both when it is one of the node's first
-- least(n_sampled, len(logprobs), len(trainer_logprobs)) sampled tokens (a NULL or empty
-- stream: none; values past the sampled tokens are not tokens). With the log ratio
-- d = trainer - inference and the ratio exp(d), k3 = (exp(d) - 1) - d: its mean over tokens
-- sampled from the inference policy estimates KL(inference || trainer) (Schulman's k3,
-- unbiased and never negative). A ratio leaves [1/c, c] when exp(d) < 1/c or exp(d) > c.
-- Per node holding at least one such token: the count and the sums the means are made of.
CREATE OR REPLACE MACRO node_mismatch(c := 2.0) AS TABLE
    WITH d AS (
        SELECT trace_id, node_index,
               list_transform(range(1, least(n_sampled, len(logprobs), len(trainer_logprobs)) + 1),
                              lambda k: exp(trainer_logprobs[k]::DOUBLE - logprobs[k]::DOUBLE)) AS ratio,
               list_transform(range(1, least(n_sampled, len(logprobs), len(trainer_logprobs)) + 1),
                              lambda k: trainer_logprobs[k]::DOUBLE - logprobs[k]::DOUBLE) AS log_ratio
        FROM nodes
        WHERE n_sampled > 0 AND logprobs IS NOT NULL AND trainer_logprobs IS NOT NULL
          AND len(logprobs) > 0 AND len(trainer_logprobs) > 0
          AND (SELECT CASE WHEN c >= 1 THEN true
                           ELSE error('policy_mismatch: c must be at least 1 (the ratio band is [1/c, c]), got ' || coalesce(c::VARCHAR, 'NULL')) END)
    )
    SELECT trace_id, node_index, len(ratio)::BIGINT AS tokens,
           list_sum(list_transform(list_zip(ratio, log_ratio), lambda p: (p[1] - 1.0) - p[2])) AS k3_sum,
           list_sum(ratio) AS ratio_sum,
           list_max(ratio) AS ratio_max,
           len(list_filter(ratio, lambda r: r < 1.0 / c OR r > c))::BIGINT AS outside
    FROM d;

-- The mismatch per trace (per := 'trace': one row per trace, node_index NULL, over its
-- sampled tokens, each node once) or per turn (per := 'turn': one row per node with
-- sampled tokens), over the tokens holding both streams (node_mismatch): how many
-- (`tokens`), the mean of k3 (`k3_mean`, an estimate of KL(inference || trainer)), the
-- mean and the largest ratio exp(trainer - inference), and the share of ratios outside
-- [1/c, c]. A trace or turn without such a token has tokens = 0 and NULL figures.
CREATE OR REPLACE MACRO policy_mismatch(c := 2.0, per := 'trace') AS TABLE
    WITH m AS (SELECT * FROM node_mismatch(c := c)),
    rows AS (
        SELECT n.trace_id, n.node_index, coalesce(m.tokens, 0)::BIGINT AS tokens,
               m.k3_sum, m.ratio_sum, m.ratio_max, coalesce(m.outside, 0)::BIGINT AS outside
        FROM nodes n LEFT JOIN m USING (trace_id, node_index)
        WHERE per = 'turn' AND n.n_sampled > 0
        UNION ALL
        SELECT t.trace_id, NULL::INTEGER, coalesce(sum(m.tokens), 0)::BIGINT,
               sum(m.k3_sum), sum(m.ratio_sum), max(m.ratio_max), coalesce(sum(m.outside), 0)::BIGINT
        FROM traces t LEFT JOIN m USING (trace_id)
        WHERE per = 'trace'
        GROUP BY t.trace_id
    )
    SELECT trace_id, node_index, tokens,
           CASE WHEN tokens > 0 THEN k3_sum / tokens END AS k3_mean,
           CASE WHEN tokens > 0 THEN ratio_sum / tokens END AS ratio_mean,
           CASE WHEN tokens > 0 THEN ratio_max END AS ratio_max,
           CASE WHEN tokens > 0 THEN outside / tokens END AS outside_share
    FROM rows
    WHERE (SELECT CASE WHEN per IN ('trace', 'turn') THEN true
                       ELSE error('policy_mismatch: per must be ''trace'' or ''turn'', got ' || coalesce(per::VARCHAR, 'NULL')) END)
    ORDER BY trace_id, node_index;
