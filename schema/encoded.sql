-- tracedb storage, schema 7: token ids and streams are kept encoded (tracedb/codec), in
-- `segment_store` and `node_store`; the macros here decode them (and encode, for writers
-- in SQL), and the views `nodes` and `segments` show them decoded, as lists, to any
-- DuckDB client. Installed into every database file after tables.sql and before
-- macros.sql (whose macros read the views). Not part of macros.sql: the lake's SQL
-- registers tables of its own under the views' names.

-- The stored layout (tracedb/codec): token ids and streams are kept as text, one
-- character per value, value u being U+(u + 32) with the surrogates skipped.
CREATE OR REPLACE MACRO tdb_value(c) AS
    unicode(c) - 32 - CASE WHEN unicode(c) >= 57344 THEN 2048 ELSE 0 END;

-- A row of token ids kept as text.
CREATE OR REPLACE MACRO tdb_tokens(t) AS
    CASE WHEN t IS NOT NULL THEN list_transform(string_split(t, ''), lambda c: tdb_value(c)::INTEGER) END;

-- Fixed-point values: m / p, -(m / p), or 2m + sign (form '~'), as float32; one lambda
-- (the sign a factor of -1, exact), so that the views bind in half the time of three.
CREATE OR REPLACE MACRO tdb_scaled(form, p, u) AS
    list_transform(u, lambda x: ((CASE WHEN form = '~' THEN x // 2 ELSE x END) / p
        * CASE WHEN form = '-' OR (form = '~' AND x % 2 = 1) THEN -1 ELSE 1 END)::FLOAT);

-- A stream kept as text: '+d', '-d' or '~d' then fixed-point values of d decimals, or '='
-- then the values' shortest decimals, comma-separated.
CREATE OR REPLACE MACRO tdb_stream(s) AS
    CASE WHEN s IS NULL THEN NULL::FLOAT[]
         WHEN left(s, 1) = '=' THEN CASE WHEN length(s) = 1 THEN []::FLOAT[] ELSE string_split(s[2:], ',')::FLOAT[] END
         ELSE tdb_scaled(left(s, 1), [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9][ascii(s[2]) - 47],
                         list_transform(string_split(s[3:], ''), lambda c: tdb_value(c)))
    END;

-- loss_weights kept as a JSON object from each name to its stream text.
CREATE OR REPLACE MACRO tdb_loss_weights(lw) AS
    CASE WHEN lw IS NULL THEN NULL::MAP(VARCHAR, FLOAT[])
         ELSE map_from_entries(list_transform(map_entries(lw::JSON::MAP(VARCHAR, VARCHAR)),
                                              lambda e: {'key': e.key, 'value': tdb_stream(e.value)}))
    END;

-- The other way, for writers in SQL (tracedb.writeback): a FLOAT[] as stream text, in the
-- decimals form ('=' then each value's shortest decimal, the sign of zero kept).
CREATE OR REPLACE MACRO tdb_stream_text(v) AS
    CASE WHEN v IS NOT NULL THEN '=' || array_to_string(list_transform(v::FLOAT[],
        lambda x: CASE WHEN x = 0 AND signbit(x) THEN '-0.0' ELSE x::VARCHAR END), ',') END;

-- A MAP(VARCHAR, FLOAT[]) of loss_weights as its stored JSON text.
CREATE OR REPLACE MACRO tdb_loss_weights_text(m) AS
    CASE WHEN m IS NOT NULL THEN
        CASE WHEN cardinality(m) = 0 THEN '{}'
             ELSE to_json(map_from_entries(list_transform(map_entries(m),
                      lambda e: {'key': e.key, 'value': tdb_stream_text(e.value)})))::VARCHAR END
    END;

-- The tables as they read: token ids and streams as lists.
CREATE OR REPLACE VIEW segments AS
    SELECT segment_id, n_tokens, coalesce(token_ids, tdb_tokens(tokens)) AS token_ids FROM segment_store;

CREATE OR REPLACE VIEW nodes AS
    SELECT trace_id, node_index, parent, role, sampled, "timestamp", segment_id, n_tokens, n_sampled,
           mask_prefix, mask_slots, is_content,
           coalesce(logprobs_list, tdb_stream(logprobs)) AS logprobs,
           coalesce(advantages_list, tdb_stream(advantages)) AS advantages,
           coalesce(reference_logprobs_list, tdb_stream(reference_logprobs)) AS reference_logprobs,
           coalesce(trainer_logprobs_list, tdb_stream(trainer_logprobs)) AS trainer_logprobs,
           coalesce(entropies_list, tdb_stream(entropies)) AS entropies, tdb_loss_weights(loss_weights) AS loss_weights,
           semantic_parents, semantic_parents_record, message, extra, present, weight_versions
    FROM node_store;
