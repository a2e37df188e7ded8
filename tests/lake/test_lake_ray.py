"""The lake on Ray: views computed in workers, ingest in tasks (one local Ray for the module).

Ray binds every interface and looks for the machine's address (it asks for a route to a
public one), so these tests run in a network namespace that has only loopback: collected
outside one, the module re-runs itself under ``unshare --net`` (root, as CI runs) and
passes or fails with that run; where no namespace can be made it is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

import tracedb

from support import FIXTURES, FIXTURES_041

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("ray", reason="the lake extra is not installed (pip install '.[lake]')")

INSIDE = os.environ.get("TRACEDB_LAKE_NETNS") == "1"
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}


def _namespace_problem() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2) for a loopback-only network namespace"
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here (unshare --net: {probe.stderr.strip()}); CI runs as root"
    return None


if not INSIDE:

    def test_in_a_loopback_only_network_namespace():
        problem = _namespace_problem()
        if problem:
            pytest.skip(f"Ray tests not run: {problem}")
        inner = f"ip link set lo up && exec {sys.executable} -m pytest -q -x -p no:cacheprovider {__file__}"
        env = {**os.environ, **ENV, "TRACEDB_LAKE_NETNS": "1"}
        run = subprocess.run(
            ["unshare", "--net", "sh", "-c", inner],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]

else:
    import ray

    import tracedb.lake as lakes
    from tracedb.lake import ingest, write

    def _only_loopback() -> bool:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        return [line.split(":")[1].strip() for line in links] == ["lo"]

    @pytest.fixture(scope="module")
    def local_ray():
        assert _only_loopback(), "the Ray tests must run in a network namespace holding only loopback"
        os.environ.update(ENV)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield ray
        ray.shutdown()

    @pytest.fixture(scope="module")
    def store(golden_store):
        return golden_store

    @pytest.fixture(scope="module")
    def pushed(store, tmp_path_factory):
        lake = lakes.init(tmp_path_factory.mktemp("lake") / "L")
        lake.push(store)
        return lake

    def _collect(dataset) -> pa.Table:
        parts = ray.get(dataset.to_arrow_refs())
        return pa.concat_tables(parts).sort_by([("trace_id", "ascending"), ("branch_index", "ascending")])

    @pytest.mark.parametrize(
        "options",
        [{}, {"trainable": True, "train_once": True}, {"columns": ["token_ids", "advantages"], "branch_index": [0, 1]}],
        ids=["all", "trainable-train-once", "columns"],
    )
    def test_views_in_workers_equal_the_file_stores(local_ray, pushed, store, options):
        got = _collect(pushed.branches(traces_per_task=7, **options))
        with tracedb.connect(store, read_only=True) as db:
            expected = db.branches(**options).replace_schema_metadata(None)
        assert got.num_rows == expected.num_rows > 0
        assert got.schema == expected.schema
        assert got.equals(expected)

    def test_views_of_a_selection(local_ray, pushed, store):
        with tracedb.connect(store, read_only=True) as db:
            group = db.sql("SELECT group_id FROM traces WHERE group_id IS NOT NULL LIMIT 1").column(0)[0].as_py()
            expected = db.branches(group=group).replace_schema_metadata(None)
        assert _collect(pushed.branches(group=group)).equals(expected)
        assert pushed.branches(trace_ids=[]).count() == 0

    def test_views_of_an_async_selection_equal_the_file_stores(local_ray, tmp_path):
        """The staleness bound, unknown versions, dropped and eval traces (verifiers 0.4.1
        fixtures): the workers' views, ``policy_version`` per token, equal the file store's."""
        store = tmp_path / "run.duckdb"
        with tracedb.connect(store) as db:
            db.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        lake = lakes.init(tmp_path / "L")
        lake.push(store)
        chosen = dict(policy=12, max_staleness=6, unknown="drop", include_dropped=False, include_eval=False)
        with tracedb.connect(store, read_only=True) as db:
            expected = db.branches(**chosen).replace_schema_metadata(None)
            every = db.branches().num_rows
        got = _collect(lake.branches(traces_per_task=5, **chosen))
        assert 0 < got.num_rows < every and got.equals(expected)
        assert got.column("policy_version").null_count < got.num_rows

    def test_views_of_complete_groups_and_tags_equal_the_file_stores(local_ray, tmp_path):
        """Groups whose members arrived in three tagged ingests, pushed in several writes:
        complete_groups / tags / after views equal db.branches' (after in each's seq)."""
        lines = [line for line in (FIXTURES / "groups.traces.jsonl").read_text().splitlines() if line.strip()]
        with tracedb.connect(tmp_path / "runs.duckdb") as db:
            ingests = [(lines[:10], ["step=1"]), (lines[10:20], ["step=2"]), (lines[20:30], [])]  # group-3 has 6
            for k, (part, tags) in enumerate(ingests):
                (tmp_path / f"{k}.jsonl").write_text("".join(line + "\n" for line in part))
                db.ingest(tmp_path / f"{k}.jsonl", tags=tags)
            lake = lakes.init(tmp_path / "L")
            lake.push(db, batch_traces=10)  # write w holds the file's seq 10(w-1)+1 .. 10w
            cases = [
                (dict(complete_groups=8), {}),
                (dict(complete_groups=4, tags={"step": (None, 2)}), {}),
                (dict(complete_groups=8, after=1, train_once=True), {"after": 10}),
                (dict(tags={"step": 2}, trainable=True), {}),
            ]
            for options, file_marks in cases:
                expected = db.branches(**{**options, **file_marks}).replace_schema_metadata(None)
                got = _collect(lake.branches(traces_per_task=3, **options))
                assert got.num_rows == expected.num_rows > 0, options
                assert got.equals(expected), options
        with pytest.raises(ValueError, match="tag 'step': a range's ends"):
            lake.branches(tags={"step": (1, "z")})

    def _runs(tmp_path: Path) -> tuple[Path, Path]:
        """Two run directories that overlap in three files; the second holds a bad line."""
        files = sorted(FIXTURES.glob("*.traces.jsonl"))
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        for f in files[:8]:
            shutil.copy(f, a / f.name)
        for f in files[5:]:
            shutil.copy(f, b / f.name)
        (b / "bad.traces.jsonl").write_text('{"not": "a trace"\n')
        return a, b

    REJECT_KEY = ("source", "line", "trace_id", "node", "field", "reason", "record_sha256")

    def _rejects(table: pa.Table) -> list[tuple]:
        """Rejects as readers compare them (what makes one reject), sorted."""
        return sorted((tuple(r[k] for k in REJECT_KEY) for r in table.select(list(REJECT_KEY)).to_pylist()), key=str)

    def _file_store(paths: list[Path], where: Path) -> tuple[list[str], dict, list[tuple], int]:
        """The file store's ingest of ``paths``: its trace ids, records, rejects and lines."""
        with tracedb.connect(where) as db:
            report = db.ingest(paths)
            ids = sorted(db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist())
            rejects = _rejects(db.sql("SELECT * FROM rejects"))
            return ids, {t: db.trace(t) for t in ids}, rejects, report.lines

    def _records(lake, ids: list[str], where: Path) -> dict:
        lake.pull(where)
        with tracedb.connect(where, read_only=True) as pulled:
            return {t: pulled.trace(t) for t in ids}

    PROCESSES = 4

    def _ingest_processes(lake_dir: Path, jobs: list[list[str]], timeout: float = 240) -> list[dict]:
        """``tracedb lake ingest`` in one process per job at once, each a driver of the
        module's Ray; their JSON reports."""
        address = ray.get_runtime_context().gcs_address
        command = [sys.executable, "-m", "tracedb", "lake", "ingest", "--lake", str(lake_dir), "--ray-address", address]
        env = {**os.environ, **ENV}
        procs = [
            subprocess.Popen(
                [*command, "--json", *job], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
            for job in jobs
        ]
        deadline = time.monotonic() + timeout
        reports = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                assert p.returncode in (0, 1), err[-3000:]  # 1: lines were rejected
                reports.append(json.loads(out))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return reports

    def _process_inputs(tmp_path: Path) -> list[Path]:
        """Six small fixtures, a file of one bad line, and a larger file of distinct traces
        with a bad line in its middle (cut into byte ranges by the ingests)."""
        from tracedb.synthetic import write_sample

        run = tmp_path / "runs"
        run.mkdir()
        for f in sorted(FIXTURES.glob("*.traces.jsonl"))[:7]:
            if f.name != "groups.traces.jsonl":
                shutil.copy(f, run / f.name)
        (run / "bad.traces.jsonl").write_text('{"not": "a trace"\n')
        big = write_sample(tmp_path / "sample.jsonl", groups=3, group_size=3, tokens_per_trace=1_500, seed=5)
        lines = big.read_bytes().splitlines(keepends=True)
        (run / "big.traces.jsonl").write_bytes(b"".join([*lines[:4], b'{"traces": [}\n', *lines[4:]]))
        return sorted(p.resolve() for p in run.iterdir())

    @pytest.mark.parametrize("layout", ["disjoint", "overlapping"])
    def test_concurrent_ingest_processes_lose_and_duplicate_nothing(local_ray, tmp_path, layout):
        """Four ``lake ingest`` processes at once into one lake, on disjoint files, or on
        overlapping ones (every file in two processes; the large one cut into ranges of two
        sizes): the lake shows each trace once, as the file store's ingest of them all."""
        from tracedb.lake.ingest import cut

        files = _process_inputs(tmp_path)
        sets = [files[k::PROCESSES] for k in range(PROCESSES)]
        if layout == "overlapping":
            sets = [sets[k] + sets[(k + 1) % PROCESSES] for k in range(PROCESSES)]
        sizes = [50_000 + 30_000 * (k % 2) for k in range(PROCESSES)]
        jobs = [
            [*map(str, s), "--range-bytes", str(n), "--files-per-task", "4", "--workers", "1"]
            for s, n in zip(sets, sizes)
        ]
        lake = lakes.init(tmp_path / "L")
        reports = _ingest_processes(tmp_path / "L", jobs)
        ids, records, rejects, lines = _file_store(files, tmp_path / "file.duckdb")
        visible = lake.tables()
        assert sorted(visible["traces"].column("trace_id").to_pylist()) == ids  # each trace once
        assert sum(r["traces"] for r in reports) == len(ids)  # committed by one writer each
        copies = 1 if layout == "disjoint" else 2
        assert sum(r["lines"] for r in reports) == copies * lines
        big = next(f for f in files if f.name == "big.traces.jsonl")  # 214 kB, the others < 12 kB
        assert [r["ranges"] for r in reports] == [len(cut(big, n)) if big in s else 0 for s, n in zip(sets, sizes)]
        cut_by = sorted(n for s, n in zip(sets, sizes) if big in s)  # overlapping: in ranges of two sizes
        assert cut_by == ([80_000] if layout == "disjoint" else [50_000, 80_000])
        assert _rejects(visible["rejects"]) == rejects and len(rejects) == 2
        assert lake.table("rejects").scan().to_arrow().num_rows == copies * len(rejects)  # shown once
        assert _records(lake, ids, tmp_path / "pulled.duckdb") == records
        if layout == "disjoint":
            return
        again = lake.ingest(files, files_per_task=len(files))  # one more writer, after them
        assert again.traces == 0 and again.skipped == again.lines - again.rejected  # every good line seen again
        assert _rejects(lake.tables()["rejects"]) == rejects

    def test_large_files_cut_into_byte_ranges_equal_the_file_store(local_ray, tmp_path):
        """A large file in many ranges (bad lines at and around the cuts, the last one
        without its line break) next to a small file and a compressed one, never cut."""
        import zstandard

        from tracedb.lake.ingest import cut

        from support.cut_files import write_cut_file

        run = (tmp_path / "run").resolve()
        run.mkdir()
        range_bytes = 32_768
        big = write_cut_file(run / "big.traces.jsonl", range_bytes, last="bad", goods=20)
        shutil.copy(FIXTURES / "linear.traces.jsonl", run / "linear.traces.jsonl")
        groups = (FIXTURES / "groups.traces.jsonl").read_bytes()
        assert len(groups) > range_bytes
        (run / "groups.traces.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(groups))
        lake = lakes.init(tmp_path / "L")
        report = lake.ingest([run], workers=2, range_bytes=range_bytes)
        ids, records, rejects, lines = _file_store([run], tmp_path / "file.duckdb")
        ranges = len(cut(big, range_bytes))
        assert ranges >= 8
        assert (report.files, report.ranges, report.tasks) == (3, ranges, ranges + 2)
        assert (report.lines, report.traces, report.rejected) == (lines, len(ids), len(rejects))
        assert len(rejects) == 8  # the seven placed and the last line
        assert sorted(lake.tables()["traces"].column("trace_id").to_pylist()) == ids
        assert _rejects(lake.tables()["rejects"]) == rejects
        assert {r[0] for r in rejects} == {str(big)}
        assert _records(lake, ids, tmp_path / "pulled.duckdb") == records

    def test_a_killed_worker_is_retried_without_duplicates(local_ray, tmp_path, store):
        lake = lakes.init(tmp_path / "L")

        def _dies_once(location, files, marker):
            """An ingest task whose worker dies after writing its data files, before it
            hands them over, the first time it runs."""
            result = ingest.ingest_files(location, files, False)
            if not os.path.exists(marker):
                Path(marker).write_text("killed")
                os._exit(1)
            return result

        # defined here, so that Ray ships it by value (workers cannot import a test module)
        task = ray.remote(max_retries=2)(_dies_once)
        result = ray.get(task.remote(lake.location, [str(FIXTURES / "groups.traces.jsonl")], str(tmp_path / "m")))
        assert (tmp_path / "m").exists()
        report = write.commit(lake, [result["staged"]])
        with tracedb.connect(":memory:") as db:
            db.ingest(FIXTURES / "groups.traces.jsonl")
            n = db.sql("SELECT count(*) FROM traces").column(0)[0].as_py()
            n_nodes = db.sql("SELECT count(*) FROM nodes").column(0)[0].as_py()
        assert report.traces == n and report.commits == 5
        visible = lake.tables()
        assert visible["traces"].num_rows == n and visible["nodes"].num_rows == n_nodes
        assert lake.table("nodes").scan().to_arrow().num_rows == n_nodes  # the dead attempt's files: never committed
        written = {str(p) for p in (tmp_path / "L" / "warehouse" / "tracedb" / "nodes").rglob("*.parquet")}
        live = {f.file_path.removeprefix("file://") for f in (t.file for t in lake.table("nodes").scan().plan_files())}
        assert live < written  # ... left unreferenced (expiry deletes them after its grace)
        expired = lake.compact(grace=0, expire_older_than=0).expired
        assert expired["nodes"]["files_deleted"] >= len(written - live)

    def test_cli_ingest(local_ray, tmp_path):
        import json

        from typer.testing import CliRunner

        from tracedb.cli.main import app

        a, b = _runs(tmp_path)
        lake = str(tmp_path / "L")
        lakes.init(lake)
        run = CliRunner().invoke
        first = run(app, ["lake", "ingest", str(a), "--lake", lake, "--workers", "2", "--json"])
        assert first.exit_code == 0, first.output
        assert json.loads(first.output)["traces"] == len(lakes.open(lake).tables()["traces"]) > 0
        second = run(app, ["lake", "ingest", str(b), "--lake", lake, "--files-per-task", "3"])
        assert second.exit_code == 1 and "1 line(s) rejected" in second.output
        missing = run(app, ["lake", "ingest", str(tmp_path / "none"), "--lake", lake])
        assert missing.exit_code == 2 and "no such file or directory" in missing.output
        got = json.loads(first.output)
        assert got["tasks"] == 8 and got["commits"] == len(got["rows"])  # 8 tasks' writes gathered: a commit per table

    def test_ingest_gathers_its_tasks_writes_into_commits_of_commit_traces(local_ray, tmp_path):
        """``--commit-traces N``: the driver commits its tasks' staged writes once they hold
        N traces (one commit per table for all of them, traces last); each commit of N = 1
        holds one task's write. The lake shows the same traces either way."""
        import json

        from typer.testing import CliRunner

        from tracedb.cli.main import app

        a, _ = _runs(tmp_path)
        files = [str(f) for f in sorted(a.iterdir())[:4]]  # 4 tasks, a trace or more each
        run = CliRunner().invoke
        reports = {}
        for n in ("1", "256"):
            lake = str(tmp_path / f"L{n}")
            lakes.init(lake)
            done = run(
                app, ["lake", "ingest", *files, "--lake", lake, "--workers", "2", "--commit-traces", n, "--json"]
            )
            assert done.exit_code == 0, done.output
            reports[n] = json.loads(done.output)
            snapshots = {name: len(lakes.open(lake).table(name).snapshots()) for name in reports[n]["rows"]}
            assert sum(snapshots.values()) == reports[n]["commits"]
            if n == "256":
                assert set(snapshots.values()) == {1}  # every table committed once
            else:
                assert snapshots["traces"] == reports[n]["tasks"]  # one commit per task's write
        one, gathered = reports["1"], reports["256"]
        assert one["traces"] == gathered["traces"] > 0 and one["rows"] == gathered["rows"]
        assert one["commits"] > gathered["commits"] == len(gathered["rows"])
        same = [
            sorted(lakes.open(str(tmp_path / f"L{n}")).tables()["traces"].column("trace_id").to_pylist())
            for n in reports
        ]
        assert same[0] == same[1]
        bad = run(app, ["lake", "ingest", *files, "--lake", str(tmp_path / "L1"), "--commit-traces", "0"])
        assert bad.exit_code == 2 and "--commit-traces" in bad.output

    @pytest.mark.parametrize("seed", [3, 11])
    def test_random_forests_ingested_and_viewed_on_ray_equal_the_file_store(local_ray, tmp_path, seed):
        from tracedb.synthetic import write_sample

        files = [
            write_sample(
                tmp_path / f"run{k}" / "traces.jsonl",
                groups=2,
                group_size=3,
                tokens_per_trace=2_500,
                compaction_every=900,
                advantages=True,
                seed=seed * 10 + k,
            )
            for k in range(2)
        ]
        lake = lakes.init(tmp_path / "L")
        assert lake.ingest([tmp_path], workers=2).traces > 0
        with tracedb.connect(":memory:") as db:
            db.ingest(files)
            expected = db.branches(train_once=True).replace_schema_metadata(None)
            stats = db.sql("SELECT * FROM branch_stats() ORDER BY ALL")
        assert expected.num_rows > db_traces(expected)  # forests: more branches than traces
        assert _collect(lake.branches(train_once=True, traces_per_task=2)).equals(expected)
        assert lake.sql("SELECT * FROM branch_stats() ORDER BY ALL").equals(stats)

    def db_traces(table: pa.Table) -> int:
        return len(set(table.column("trace_id").to_pylist()))

    def test_group_credit_in_a_ray_groupby_equals_the_file_stores(local_ray, store, tmp_path):
        import json

        from typer.testing import CliRunner

        from tracedb import credit
        from tracedb.cli.main import app

        lake = lakes.init(tmp_path / "L")
        lake.push(store, batch_traces=25)  # several writes: the credit rows must follow each trace's
        file = tmp_path / "file.duckdb"
        shutil.copy(store, file)
        runs = [("grpo", "g", {}), ("grpo", "gs", {"scale_std": True}), ("rloo", "r", {"include_failed": True})]
        with tracedb.connect(file) as db:
            for algorithm, name, params in runs:
                credit.run(db, algorithm, name, **params)
            want = db.sql("SELECT credit_set, trace_id, value FROM trace_credit ORDER BY ALL")
            sets = db.sql("SELECT name, algorithm, params, layout FROM credit_sets ORDER BY name")
            plan = db.micro_batches(512, credit="gs")
        for algorithm, name, params in runs[:2]:
            assert lake.credit(algorithm, name, **params)["rows"] > 0
        cli = CliRunner().invoke(
            app, ["lake", "credit", "rloo", "--name", "r", "-p", "include_failed=true", "--lake", lake.where, "--json"]
        )
        assert cli.exit_code == 0, cli.output
        assert json.loads(cli.output)["rows"] == pa.compute.sum(pa.compute.equal(want.column(0), "r")).as_py()
        visible = lake.tables()
        got = visible["trace_credit"].sort_by([(c, "ascending") for c in ("credit_set", "trace_id", "value")])
        assert got.cast(want.schema).equals(want)
        assert visible["credit_sets"].select(sets.column_names).sort_by("name").cast(sets.schema).equals(sets)
        assert lake.micro_batches(512, credit="gs")[0][0].tokens.equals(plan[0][0].tokens)
        with pytest.raises(tracedb.errors.WriteError, match="credit set 'g' exists in the lake"):
            lake.credit("grpo", "g")
        with pytest.raises(ValueError, match="lake credit computes"):
            lake.credit("gae", "x")

    def test_group_credit_on_a_selection_steps_through_a_run_as_the_file_store_does(local_ray, store, tmp_path):
        from typer.testing import CliRunner

        from tracedb import credit
        from tracedb.cli.main import app

        lake = lakes.init(tmp_path / "L")
        lake.push(store, batch_traces=25)
        file = tmp_path / "file.duckdb"
        shutil.copy(store, file)
        with tracedb.connect(file) as db:
            groups = db.sql("SELECT DISTINCT group_id FROM traces WHERE group_id IS NOT NULL ORDER BY 1")
            groups = groups.column(0).to_pylist()
            steps = [groups[: len(groups) // 2], groups[len(groups) // 2 :]]
            for step in steps:
                credit.run(db, "grpo", "g", selection=tracedb.Selection(group=step))
            want = db.sql("SELECT credit_set, trace_id, value FROM trace_credit ORDER BY ALL")
        assert len(steps[0]) >= 2 and want.num_rows > 0
        first = lake.credit("grpo", "g", group=steps[0])
        assert first["traces"] > 0 and first["watermark"] == lake.watermark() and "dropped" in first["selection"]
        with pytest.raises(tracedb.errors.WriteError, match="already holds .* selected traces"):
            lake.credit("grpo", "g", group=steps[0][:1])
        with pytest.raises(tracedb.errors.WriteError, match="holds grpo with"):
            lake.credit("grpo", "g", group=steps[1], scale_std=True)
        with pytest.raises(ValueError, match="max_staleness needs policy"):
            lake.credit("grpo", "g", max_staleness=1)
        cli = CliRunner().invoke(
            app, ["lake", "credit", "grpo", "--name", "g", *[f"--group={g}" for g in steps[1]], "--lake", lake.where]
        )
        assert cli.exit_code == 0, cli.output
        bad = ["lake", "credit", "grpo", "--name", "g", "--max-staleness", "1", "--lake", lake.where]
        bad = CliRunner().invoke(app, bad)
        assert bad.exit_code == 2 and "max_staleness needs policy" in bad.output
        assert "--complete-groups" in CliRunner().invoke(app, ["lake", "credit", "--help"], terminal_width=200).output
        got = lake.tables()["trace_credit"].sort_by([(c, "ascending") for c in ("credit_set", "trace_id", "value")])
        assert got.select(want.column_names).cast(want.schema).equals(want)
        assert len(lake.tables()["credit_sets"]) == 1  # one set, made by the first step

    def test_group_credit_leaves_dropped_and_eval_traces_out_as_the_file_store_does(local_ray, tmp_path):
        from tracedb import credit

        store = tmp_path / "run.duckdb"
        with tracedb.connect(store) as db:
            db.ingest([FIXTURES_041 / "dropped_group.traces.jsonl", FIXTURES_041 / "eval_work.traces.jsonl"])
            left_out = db.sql("SELECT count(*) FROM traces WHERE dropped IS NOT NULL OR work_type = 'eval'")
            assert left_out.column(0)[0].as_py() > 0
        lake = lakes.init(tmp_path / "L")
        lake.push(store)
        with tracedb.connect(store) as db:
            credit.run(db, "grpo", "g")
            want = db.sql("SELECT credit_set, trace_id, value FROM trace_credit ORDER BY ALL")
            every = db.sql("SELECT count(*) FROM traces WHERE reward IS NOT NULL").column(0)[0].as_py()
        lake.credit("grpo", "g")
        got = lake.tables()["trace_credit"].sort_by([(c, "ascending") for c in ("credit_set", "trace_id", "value")])
        assert got.select(want.column_names).cast(want.schema).equals(want)
        assert 0 < want.num_rows < every  # dropped and eval traces unassigned
