"""A pool of N gloo ranks kept alive across test cases (a property test draws hundreds of
cases; starting a process group per case would cost seconds each).

``pool.run(fn, *args)`` runs ``fn(rank, world, *args)`` on every rank and returns the
results in rank order. A rank that raises, or a case that does not finish within the
timeout, makes ``run`` raise with every rank's traceback, and the pool restarts its ranks
(their collectives may be out of step after a failure).
"""

import os
import pickle
import time
import traceback
from multiprocessing.connection import Connection

import torch.multiprocessing as mp

from grace_dgc.launch import free_port


def _serve(rank, world, port, inbox, outbox):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = pickle.loads(job)
        try:
            outbox.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world, timeout=120.0):
        self.world, self.timeout = world, timeout
        self.procs = []
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.inboxes = [ctx.SimpleQueue() for _ in range(self.world)]
        self.outbox = ctx.SimpleQueue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.world, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(self.world)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn, *args):
        job = pickle.dumps((fn, args))
        for inbox in self.inboxes:
            inbox.put(job)
        results, failures = {}, {}
        deadline = time.monotonic() + self.timeout
        while len(results) + len(failures) < self.world:
            if self.outbox.empty():
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    break
                time.sleep(0.005)
                continue
            rank, ok, value = self.outbox.get()
            (results if ok else failures)[rank] = pickle.loads(value) if ok else value
            if not ok:  # the others may be waiting for the failed rank: a moment to fail too
                deadline = min(deadline, time.monotonic() + 5)
        if len(results) == self.world:
            return [results[r] for r in range(self.world)]
        self.restart()
        silent = sorted(set(range(self.world)) - set(results) - set(failures))
        report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(
            f"{len(failures)} rank(s) failed, ranks {silent} gave no answer within {self.timeout:.0f}s{report}"
        )

    def restart(self):
        self.close()
        self._start()

    def close(self):
        for proc in self.procs:
            proc.kill()
            proc.join(5)
        self.procs = []


class HorovodPool:
    """The same, with N ranks under ``horovodrun -np N --gloo`` (Horovod's engine): each
    rank connects back to this process and serves jobs until told to stop."""

    def __init__(self, world, horovodrun, timeout=120.0):
        import socket
        import subprocess
        import sys

        self.world, self.timeout = world, timeout
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(timeout)
        port = server.getsockname()[1]
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        cmd = [horovodrun, "-np", str(world), "--gloo", "-H", f"localhost:{world}", "--gloo-timeout-seconds", "60"]
        cmd += [sys.executable, os.path.abspath(__file__), str(port)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.conns = {}
        try:
            while len(self.conns) < world:
                sock, _ = server.accept()
                sock.settimeout(None)
                conn = Connection(sock.detach())
                self.conns[pickle.loads(conn.recv_bytes())] = conn
        except OSError as error:
            self.proc.kill()
            raise AssertionError(
                f"horovodrun ranks did not connect ({error}):\n{self.proc.communicate()[0][-4000:]}"
            ) from error
        finally:
            server.close()

    def run(self, fn, *args):
        job = pickle.dumps((fn, args))
        for conn in self.conns.values():
            conn.send_bytes(job)
        results, failures = {}, {}
        for rank, conn in sorted(self.conns.items()):
            if not conn.poll(self.timeout):
                failures[rank] = f"no answer within {self.timeout:.0f}s"
                break
            ok, value = pickle.loads(conn.recv_bytes())
            (results if ok else failures)[rank] = value
        if failures:
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"horovod ranks failed{report}")
        return [pickle.loads(results[r]) for r in range(self.world)]

    def close(self):
        for conn in self.conns.values():
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


def _serve_horovod(port):
    import socket

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")  # hierarchical forms process sets
    conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    conn.send_bytes(pickle.dumps(hvd.rank()))
    while True:
        job = pickle.loads(conn.recv_bytes())
        if job is None:
            break
        fn, args = job
        try:
            conn.send_bytes(pickle.dumps((True, pickle.dumps(fn(hvd.rank(), hvd.size(), *args)))))
        except BaseException:
            conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    hvd.shutdown()


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _serve_horovod(int(sys.argv[1]))
