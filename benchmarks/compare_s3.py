"""Compare checkpointing to an S3-compatible object store: pyckpt vs DCP+s3fs vs s3torchconnector.

Usage:
    python benchmarks/compare_s3.py [--size-mib 1024] [--ranks 2] [--repeats 3] [--json out.json]
        [--https] [--per-connection-mbps R] [--reshard-ranks 3]
    python benchmarks/compare_s3.py --size-mib 16 --repeats 1      # smoke run

Same run, same local SeaweedFS server (started here from tests/_s3server.py unless
``--endpoint`` names one; credentials then come from the AWS_* variables), same state dict: a
bf16 "model" of ``--size-mib`` MiB with trained-weight-like values (randn x 0.02), sharded on
dim 0 over ``--ranks`` gloo ranks as DTensors (FSDP-style). For each method and repeat: a save
(timed from the first rank's start to the last rank's end, barriers around it), then a same-
sharding load into zeroed tensors (checked bit-exact). Methods, alternating within each repeat:

* ``pyckpt-raw``, ``pyckpt-zstd``: ``pyckpt.Writer``/``Reader`` on ``s3://`` URLs.
* ``dcp-fsspec``: DCP's ``FsspecWriter``/``FsspecReader`` over ``s3fs``.
* ``s3torchconnector``: AWS's ``S3StorageWriter``/``S3StorageReader`` (reported as unavailable
  when the package is missing).

Bytes uploaded are the sizes of the objects each save left under its prefix; bytes downloaded
are counted by pyckpt's reader (``Reader.bytes_fetched``) and, for the baselines, taken as the
objects' total (a same-sharding load reads every stored byte; not counted per request).

Then every saved checkpoint is loaded again by ``--reshard-ranks`` ranks (default 3: a
resharded load, DTensor's own uneven ``Shard(0)`` split), checked bit-exact; for pyckpt it
reports the bytes fetched against the bytes each rank needs (the issue's <= 1.1x).

Also the CPU seconds each save used: all client ranks (``time.process_time``) and the local
server process (``/proc/<pid>/stat``), which shows what bounds the saves on a small machine.

``--https`` runs everything over the local server's TLS port (self-signed certificate).
``--per-connection-mbps R`` caps every TCP connection to the server at R MB/s (HTB classes on
the loopback interface, keyed by a hash of the client's port; needs root and ``tc``, removed at
the end), as a store that serves each connection at a fixed rate does (S3: about 85-90 MB/s).

Then ``--client-mib`` MiB single-object upload/download throughput, obstore vs boto3 (s3transfer,
multipart 16 MiB parts, 8 in flight on both sides): the client choice of docs/OBJECT_STORES.md.

Prints medians with [min-max] over the repeats. Absolute figures depend on the machine (the
server shares its cores with the client); compare methods within one run.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

BUCKET = "pyckpt-bench"
METHODS = ("pyckpt-raw", "pyckpt-zstd", "dcp-fsspec", "s3torchconnector")
TENSOR_MIB = 32  # size of each (full) tensor


def _tensor_count(size_mib: int) -> int:
    return max(1, size_mib // TENSOR_MIB)


def _shape(size_mib: int, save_world: int) -> tuple[int, int]:
    """(rows, cols) of each bf16 tensor of the model saved by ``save_world`` ranks."""
    elems = (min(size_mib, TENSOR_MIB) << 20) // 2
    cols = 4096 if elems >= 4096 * save_world else 64
    return elems // cols, cols


def _local_state(rank: int, world: int, size_mib: int, mesh: Any, zeros: bool) -> dict[str, Any]:
    """This rank's dim-0 shards of the model, as DTensors (built from local data only)."""
    from torch.distributed.tensor import DTensor, Shard

    rows, cols = _shape(size_mib, world)
    out: dict[str, Any] = {}
    for i in range(_tensor_count(size_mib)):
        lo, hi = rows * rank // world, rows * (rank + 1) // world
        if zeros:
            local = torch.zeros(hi - lo, cols, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(1000 * i + rank)
            local = (torch.randn(hi - lo, cols, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def _saved_tensor(i: int, save_world: int, size_mib: int) -> torch.Tensor:
    """The whole tensor ``layers.{i}.weight`` as :func:`_local_state` saved it."""
    rows, cols = _shape(size_mib, save_world)
    parts = []
    for r in range(save_world):
        g = torch.Generator().manual_seed(1000 * i + r)
        lo, hi = rows * r // save_world, rows * (r + 1) // save_world
        parts.append((torch.randn(hi - lo, cols, generator=g) * 0.02).to(torch.bfloat16))
    return torch.cat(parts)


def _resharded_zeros(rank: int, world: int, save_world: int, size_mib: int,
                     mesh: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """Zeroed ``Shard(0)`` DTensors over ``world`` ranks (DTensor's own split, uneven when
    ``world`` does not divide the rows), and each one's first global row on this rank."""
    from torch.distributed.tensor import DTensor, Shard

    rows, cols = _shape(size_mib, save_world)
    sizes = [c.shape[0] for c in torch.empty(rows, 0).chunk(world)]
    sizes += [0] * (world - len(sizes))
    offset = sum(sizes[:rank])
    out: dict[str, Any] = {}
    starts: dict[str, int] = {}
    for i in range(_tensor_count(size_mib)):
        local = torch.zeros(sizes[rank], cols, dtype=torch.bfloat16)
        key = f"layers.{i}.weight"
        out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                      shape=torch.Size((rows, cols)), stride=(cols, 1))
        starts[key] = offset
    return out, starts


def _writer_reader(method: str, url: str, env: dict[str, str]) -> tuple[Any, Any]:
    if method.startswith("pyckpt"):
        import pyckpt

        comp = "zstd" if method == "pyckpt-zstd" else None
        # obstore takes no CA file: over TLS it skips verifying the test certificate.
        opts = {"allow_invalid_certificates": True} if "SSL_CERT_FILE" in env else None
        return (pyckpt.Writer(url, compression=comp, storage_options=opts),
                pyckpt.Reader(url, storage_options=opts))
    if method == "dcp-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        opts = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"],
                                  "region_name": env["AWS_REGION"]}}
        return FsspecWriter(url, **opts), FsspecReader(url, **opts)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    cfg = S3ClientConfig(force_path_style=True)
    region = env["AWS_REGION"]
    w = S3StorageWriter(region, url, s3client_config=cfg)
    r = S3StorageReader(region, url, s3client_config=cfg)
    for x in (w, r):  # the endpoint is an S3Client argument only
        x.fs._client = S3Client(region, endpoint=env["AWS_ENDPOINT_URL"], s3client_config=cfg)
    return w, r


def _shape_connections(port: int, mbps: float) -> None:
    """Caps each TCP connection to 127.0.0.1:``port`` at ``mbps`` MB/s, as a store that serves
    each connection at a fixed rate does (S3 serves one connection at about 85-90 MB/s and
    scales with connections): an HTB class per bucket of a 256-way hash of the client's port
    on the loopback interface. Needs root and ``tc``; :func:`_unshape` removes it."""
    import subprocess
    import tempfile

    if os.geteuid() != 0 or shutil.which("tc") is None:
        raise SystemExit("--per-connection-mbps needs root and tc (iproute2)")
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True, capture_output=True,
                           text=True).stdout
    if "htb" in shown or "root" in shown and "noqueue" not in shown:
        raise SystemExit(f"lo already has a queueing discipline, not touching it: {shown}")
    mbit = mbps * 8
    classes, filters = [], []
    for i in range(256):
        classes.append(f"class add dev lo parent 1: classid 1:{0x100 + i:x} htb rate {mbit}mbit "
                       f"ceil {mbit}mbit burst 256k cburst 256k quantum 65536")
        filters.append(f"filter add dev lo parent 1: prio 1 protocol ip u32 ht 2:{i:x}: "
                       f"match ip dport {port} 0xffff flowid 1:{0x100 + i:x}")
    with tempfile.TemporaryDirectory() as d:
        for name, lines in (("classes", classes), ("filters", filters)):
            with open(os.path.join(d, name), "w") as f:
                f.write("\n".join(lines) + "\n")
        steps = [
            "tc qdisc add dev lo root handle 1: htb default 1",
            "tc class add dev lo parent 1: classid 1:1 htb rate 100gbit burst 1m quantum 200000",
            f"tc -b {d}/classes",
            "tc filter add dev lo parent 1: prio 1 handle 2: protocol ip u32 divisor 256",
            # TCP source port (low byte) -> bucket; at 20 = the TCP header after a 20-byte IP one
            f"tc filter add dev lo parent 1: prio 1 protocol ip u32 ht 800:: match ip dport "
            f"{port} 0xffff hashkey mask 0x00ff0000 at 20 link 2:",
            f"tc -b {d}/filters",
        ]
        try:
            for step in steps:
                subprocess.run(step.split(), check=True, capture_output=True)
        except BaseException:
            _unshape()
            raise


def _unshape() -> None:
    import subprocess

    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def _server_cpu(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) the local server process has used so far."""
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _save_then_load(rank: int, world: int, mesh: Any, args: dict[str, Any],
                    env: dict[str, str]) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    """Per job (method, repeat): a timed save of this rank's state, then a timed same-sharding
    load into zeros, checked."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sd = _local_state(rank, world, args["size_mib"], mesh, zeros=False)

    def run(job: tuple[Any, ...], row: dict[str, Any]) -> None:
        method, rep = job
        row["repeat"] = rep
        url = f"s3://{BUCKET}/{method}/{rep}-{args['run']}"
        w, r = _writer_reader(method, url, env)
        dist.barrier()
        srv0, cpu0 = _server_cpu(args["server_pid"]), time.process_time()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=w)
        row["save_cpu_s"] = time.process_time() - cpu0
        dist.barrier()
        row["save_s"] = time.perf_counter() - t0
        row["server_cpu_s"] = _server_cpu(args["server_pid"]) - srv0
        out = _local_state(rank, world, args["size_mib"], mesh, zeros=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=r)
        dist.barrier()
        row["load_s"] = time.perf_counter() - t0
        row["exact"] = all(torch.equal(out[k].to_local().view(torch.int16),
                                       sd[k].to_local().view(torch.int16)) for k in sd)
        row["fetched"] = int(getattr(r, "bytes_fetched", -1))
        row["url"] = url
        for x in (w, r):
            if hasattr(x, "close"):
                x.close()

    return run


def _resharded_load(rank: int, world: int, mesh: Any, args: dict[str, Any],
                    env: dict[str, str]) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    """Per job (method, url): a timed load of that checkpoint at this group's world size,
    checked."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def run(job: tuple[Any, ...], row: dict[str, Any]) -> None:
        method, url = job
        _, r = _writer_reader(method, url, env)
        out, starts = _resharded_zeros(rank, world, args["save_world"], args["size_mib"], mesh)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=r)
        dist.barrier()
        row["load_s"] = time.perf_counter() - t0
        row["needed"] = sum(v.to_local().nbytes for v in out.values())
        row["fetched"] = int(getattr(r, "bytes_fetched", -1))
        exact = True
        for i in range(_tensor_count(args["size_mib"])):
            key = f"layers.{i}.weight"
            local = out[key].to_local()
            whole = _saved_tensor(i, args["save_world"], args["size_mib"])
            want = whole[starts[key]:starts[key] + local.shape[0]]
            exact &= torch.equal(local.view(torch.int16), want.view(torch.int16))
        row["exact"] = exact
        if hasattr(r, "close"):
            r.close()

    return run


def _rank(rank: int, world: int, port: int, args: dict[str, Any], env: dict[str, str],
          q: Any) -> None:
    """One gloo rank: ``args["body"](rank, world, mesh, args, env)`` sets up this rank and
    returns the function that runs each of ``args["jobs"]`` (the first element of a job is its
    method) into a row; puts this rank's rows on ``q``."""
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30))
    try:
        mesh = init_device_mesh("cpu", (world,))
        run = args["body"](rank, world, mesh, args, env)
        results: list[dict[str, Any]] = []
        for job in args["jobs"]:
            row: dict[str, Any] = {"method": job[0]}
            try:
                run(tuple(job), row)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                row["trace"] = traceback.format_exc()
            results.append(row)
            ok = torch.tensor([0 if "error" in row else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not int(ok):  # one rank failed: the others may be stuck mid-protocol
                row.setdefault("error", "another rank failed")
        q.put((rank, results))
    except BaseException:
        q.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _run_group(target: Any, world: int, args: dict[str, Any],
               env: dict[str, str]) -> dict[int, Any]:
    """Runs ``target(rank, world, port, args, env, q)`` on ``world`` spawned gloo ranks;
    returns each rank's result (a traceback string for a rank that failed)."""
    from dist_utils import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, args, env, q))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank: dict[int, Any] = {}
    while len(per_rank) < world:
        r, res = q.get(timeout=3600)
        per_rank[r] = res
    for p in procs:
        p.join()
    return per_rank


def _good_jobs(per_rank: dict[int, list[dict[str, Any]]], errors: dict[str, str],
               what: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(method, every rank's row) of each job that no rank failed; the others go to ``errors``
    (keyed by method + ``what``) and their traceback to stderr."""
    for i, row0 in enumerate(per_rank[0]):
        ranks = [per_rank[r][i] for r in sorted(per_rank)]
        bad = [x for x in ranks if "error" in x]
        if bad:
            errors[row0["method"] + what] = bad[0]["error"]
            print(f"{row0['method']}{what} (job {i}) failed:\n{bad[0].get('trace', '')}",
                  file=sys.stderr)
            continue
        yield row0["method"], ranks


def _available(method: str) -> str | None:
    mods = {"dcp-fsspec": ["s3fs", "torch.distributed.checkpoint._fsspec_filesystem"],
            "s3torchconnector": ["s3torchconnector.dcp"]}.get(method, [])
    if method.startswith("pyckpt"):
        mods = ["obstore"]
    for m in mods:
        try:
            __import__(m)
        except Exception as e:  # ImportError, or a broken native extension
            return f"unavailable ({m}: {type(e).__name__}: {e})"
    return None


def _stat(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _client_bench(srv: Any, env: dict[str, str], mib: int, repeats: int) -> dict[str, Any]:
    """Single-object upload/download throughput (MB/s), obstore vs boto3."""
    import obstore
    from obstore.store import S3Store

    data = os.urandom(mib << 20)
    store = S3Store(BUCKET, endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                    access_key_id=env["AWS_ACCESS_KEY_ID"],
                    secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                    client_options={"allow_http": True, "allow_invalid_certificates": True})
    out: dict[str, Any] = {}
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          region_name=env["AWS_REGION"],
                          config=Config(s3={"addressing_style": "path"},
                                        max_pool_connections=16))
        tc = TransferConfig(multipart_chunksize=16 << 20, multipart_threshold=16 << 20,
                            max_concurrency=8)
    except ImportError:
        s3 = None
    mb = len(data) / 1e6
    for rep in range(repeats):
        key = f"client/{rep}-{uuid.uuid4().hex[:6]}"
        t = time.perf_counter()
        obstore.put(store, key + "-o", data, chunk_size=16 << 20, max_concurrency=8)
        out.setdefault("obstore_put", []).append(mb / (time.perf_counter() - t))
        t = time.perf_counter()
        got = obstore.get(store, key + "-o").bytes()
        out.setdefault("obstore_get", []).append(mb / (time.perf_counter() - t))
        assert len(got) == len(data)
        if s3 is not None:
            t = time.perf_counter()
            s3.upload_fileobj(io.BytesIO(data), BUCKET, key + "-b", Config=tc)
            out.setdefault("boto3_put", []).append(mb / (time.perf_counter() - t))
            buf = io.BytesIO()
            t = time.perf_counter()
            s3.download_fileobj(BUCKET, key + "-b", buf, Config=tc)
            out.setdefault("boto3_get", []).append(mb / (time.perf_counter() - t))
            assert buf.getbuffer().nbytes == len(data)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--client-mib", type=int, default=256)
    ap.add_argument("--reshard-ranks", type=int, default=3,
                    help="then load every saved checkpoint on this many ranks (0: skip)")
    ap.add_argument("--endpoint", default=None,
                    help="use this S3 endpoint (AWS_* credentials) instead of a local server")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--server-args", default="-master.volumeSizeLimitMB=1024",
                    help="extra 'weed server' options for the local server (default: 1 GiB "
                         "volumes, so the runs do not wait on the master growing 64 MiB ones)")
    ap.add_argument("--per-connection-mbps", type=float, default=None,
                    help="cap each connection to the local server at this many MB/s (root, tc; "
                         "a model of a store that serves each connection at a fixed rate)")
    ap.add_argument("--https", action="store_true",
                    help="reach the local server over TLS (self-signed certificate), as object "
                         "stores are reached in production")
    a = ap.parse_args()

    srv = None
    if a.endpoint:
        env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        env.update(AWS_ENDPOINT_URL=a.endpoint, AWS_REGION=os.environ.get("AWS_REGION",
                   "us-east-1"), AWS_ALLOW_HTTP="true")
    else:
        from _s3server import SeaweedServer

        srv = SeaweedServer(extra_args=a.server_args.split(), https=a.https).start()
        env = srv.env()
        if a.https:
            if srv.https_endpoint is None or srv.certificate is None:
                print("--https needs openssl to make the server's certificate", file=sys.stderr)
                return 1
            # The clients trust the server's self-signed certificate: the AWS CRT through
            # SSL_CERT_FILE, botocore through AWS_CA_BUNDLE; obstore skips verifying it.
            del env["AWS_ALLOW_HTTP"]
            env.update(AWS_ENDPOINT_URL=srv.https_endpoint, SSL_CERT_FILE=srv.certificate,
                       AWS_CA_BUNDLE=srv.certificate)
    os.environ.update(env)
    shaped = False
    try:
        if srv is not None:
            srv.create_bucket(BUCKET)
        if a.per_connection_mbps:
            if srv is None:
                raise SystemExit("--per-connection-mbps shapes the local server only")
            _shape_connections(srv.https_port if a.https else srv.s3_port, a.per_connection_mbps)
            shaped = True
        methods, skipped = [], {}
        for m in a.methods.split(","):
            why = _available(m)
            if why:
                skipped[m] = why
            else:
                methods.append(m)
        args = {"size_mib": a.size_mib, "methods": methods, "body": _save_then_load,
                "jobs": [(m, rep) for rep in range(a.repeats) for m in methods],
                "run": uuid.uuid4().hex[:6],
                "server_pid": srv.proc.pid if srv is not None and srv.proc else None}
        per_rank = _run_group(_rank, a.ranks, args, env)
        if any(isinstance(v, str) for v in per_rank.values()):
            print("\n".join(v for v in per_rank.values() if isinstance(v, str)))
            return 1

        import boto3
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          region_name=env["AWS_REGION"],
                          config=Config(s3={"addressing_style": "path"}))

        def stored(url: str) -> int:
            prefix = url.split("/", 3)[3] + "/"
            total = 0
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                     Prefix=prefix):
                total += sum(int(o["Size"]) for o in page.get("Contents", []))
            return total

        rows: dict[str, dict[str, list[Any]]] = {}
        errors: dict[str, str] = {}
        for m, ranks in _good_jobs(per_rank, errors, ""):
            row0 = ranks[0]
            d = rows.setdefault(m, {})
            d.setdefault("save", []).append(row0["save_s"])
            d.setdefault("load", []).append(row0["load_s"])
            d.setdefault("exact", []).append(all(x["exact"] for x in ranks))
            d.setdefault("client_cpu", []).append(sum(x["save_cpu_s"] for x in ranks))
            d.setdefault("server_cpu", []).append(row0["server_cpu_s"])
            up = stored(row0["url"])
            d.setdefault("up", []).append(up)
            fetched = sum(x["fetched"] for x in ranks)
            d.setdefault("down", []).append(fetched if fetched >= 0 else up)
        raw = a.size_mib << 20
        cap = f", {a.per_connection_mbps:g} MB/s per connection" if shaped else ""
        print(f"\n{a.size_mib} MiB bf16, {a.ranks} ranks, {a.repeats} repeat(s); "
              f"median [min-max]; server {env['AWS_ENDPOINT_URL']}{cap}")
        print(f"{'method':<18} {'save s':>20} {'load s':>20} {'save MB/s':>10} "
              f"{'up MiB':>9} {'down MiB':>9} {'exact':>6}")
        for m in args["methods"]:
            if m not in rows:
                continue
            d = rows[m]
            mbps = raw / 1e6 / statistics.median(d["save"])
            print(f"{m:<18} {_stat(d['save']):>20} {_stat(d['load']):>20} {mbps:>10.0f} "
                  f"{statistics.median(d['up']) / 2**20:>9.1f} "
                  f"{statistics.median(d['down']) / 2**20:>9.1f} {str(all(d['exact'])):>6}")
        for m, why in {**skipped, **errors}.items():
            print(f"{m:<18} {why}")
        print("\nCPU seconds used during the save (user + system), median [min-max]: all "
              "client ranks, and the local server")
        for m in args["methods"]:
            if m in rows:
                print(f"  {m:<18} client {_stat(rows[m]['client_cpu']):>20}   "
                      f"server {_stat(rows[m]['server_cpu']):>20}")

        reshard: dict[str, dict[str, list[Any]]] = {}
        jobs = [(x["method"], x["url"]) for x in per_rank[0] if "url" in x and "error" not in x]
        if a.reshard_ranks > 0 and jobs:
            rargs = {"size_mib": a.size_mib, "save_world": a.ranks, "jobs": jobs,
                     "body": _resharded_load}
            rper = _run_group(_rank, a.reshard_ranks, rargs, env)
            if any(isinstance(v, str) for v in rper.values()):
                print("\n".join(v for v in rper.values() if isinstance(v, str)))
                return 1
            for m, ranks in _good_jobs(rper, errors, " (resharded load)"):
                d = reshard.setdefault(m, {})
                d.setdefault("load", []).append(ranks[0]["load_s"])
                d.setdefault("exact", []).append(all(x["exact"] for x in ranks))
                d.setdefault("needed", []).append(sum(x["needed"] for x in ranks))
                if all(x["fetched"] >= 0 for x in ranks):
                    d.setdefault("fetched", []).append(sum(x["fetched"] for x in ranks))
                    # The worst rank: fetched over what it needs (its rows' raw bytes, and for a
                    # compressed checkpoint those rows' share of the stored bytes).
                    share = statistics.median(rows[m]["up"]) / raw
                    d.setdefault("worst", []).append(max(x["fetched"] / (x["needed"] * share)
                                                         for x in ranks))
            print(f"\nresharded load, saved by {a.ranks} ranks, loaded by {a.reshard_ranks} "
                  f"(Shard(0), DTensor's split), median [min-max]; fetched counted by pyckpt's "
                  f"reader; 'worst rank' = max over ranks of fetched / (its rows' raw bytes x "
                  f"the stored/raw ratio)")
            print(f"{'method':<18} {'load s':>20} {'fetched MiB':>12} {'needed MiB':>11} "
                  f"{'worst rank':>11} {'exact':>6}")
            for m in args["methods"]:
                if m not in reshard:
                    continue
                d = reshard[m]
                fetched = (f"{statistics.median(d['fetched']) / 2**20:.1f}" if "fetched" in d
                           else "-")
                worst = f"{max(d['worst']):.3f}x" if "worst" in d else "-"
                print(f"{m:<18} {_stat(d['load']):>20} {fetched:>12} "
                      f"{statistics.median(d['needed']) / 2**20:>11.1f} {worst:>11} "
                      f"{str(all(d['exact'])):>6}")

        client = {}
        if a.client_mib > 0:
            client = _client_bench(srv, env, a.client_mib, a.repeats)
            print(f"\nclient throughput, one {a.client_mib} MiB object, MB/s, median [min-max]")
            for k, v in client.items():
                print(f"  {k:<12} {_stat(v)}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "rows": rows, "errors": errors, "skipped": skipped,
                           "reshard": reshard, "client": client}, f, indent=1)
    finally:
        if shaped:
            _unshape()
        if srv is not None:
            srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
