"""E2B's control plane through its SDK against bud: listing sandboxes with metadata, state,
template filters and pages, a sandbox's metrics, and forks that keep the parent's state.
Prints what it saw as one JSON object (asserted by server/tests/compat.rs)."""

import asyncio
import json
import urllib.error
import urllib.request

import httpx
from e2b import SandboxQuery, SandboxState
from e2b_code_interpreter import AsyncSandbox, Sandbox

seen = {}
alice = Sandbox.create(template="base", timeout=1800, metadata={"user": "alice", "k&": "v=1 x"})
bob = Sandbox.create(template="base", timeout=1800, metadata={"user": "bob"})
mine = {alice.sandbox_id, bob.sandbox_id}


def listed(query=None, limit=None):
    """Every page of a listing, as [[ids of a page], ...], only this script's sandboxes."""
    pages = []
    paginator = Sandbox.list(query=query, limit=limit)
    while paginator.has_next:
        pages.append([s.sandbox_id for s in paginator.next_items() if s.sandbox_id in mine])
    return pages


def names(ids):
    return sorted("alice" if i == alice.sandbox_id else "bob" for i in ids)


seen["all"] = names(listed()[0])
seen["by_user"] = names(listed(SandboxQuery(metadata={"user": "alice"}))[0])
seen["by_odd_metadata"] = names(listed(SandboxQuery(metadata={"k&": "v=1 x"}))[0])
seen["by_no_match"] = listed(SandboxQuery(metadata={"user": "carol"}))
seen["running"] = names(listed(SandboxQuery(state=[SandboxState.RUNNING]))[0])
seen["paused"] = listed(SandboxQuery(state=[SandboxState.PAUSED]))
seen["by_template"] = names(listed(SandboxQuery(template="base"))[0])
pages = listed(limit=1)
seen["pages_of_one"] = [len(p) for p in pages if p]
seen["pages_cover"] = names([i for p in pages for i in p])
info = [s for s in Sandbox.list().next_items() if s.sandbox_id == alice.sandbox_id][0]
seen["info"] = [info.template_id, info.state.value, info.metadata, info.cpu_count]

alice.run_code("x = 41")
metrics = alice.get_metrics()
m = metrics[-1]
seen["metrics"] = [len(metrics), m.cpu_count, m.mem_used > 0, m.mem_total, m.disk_total,
                   0.0 < m.cpu_used_pct <= 100.0]

# Signed URLs: plain HTTP without any header; the signature names the sandbox.
alice.files.write("/home/user/signed.txt", "for the signed url\n")


def fetch(url):
    try:
        with urllib.request.urlopen(url) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, json.loads(e.read()).get("message", "")[:40]]


seen["download"] = fetch(alice.download_url("/home/user/signed.txt"))
seen["download_expiring"] = fetch(alice.download_url("/home/user/signed.txt",
                                                     use_signature_expiration=60))[0]
seen["download_expired"] = fetch(alice.download_url("/home/user/signed.txt",
                                                    use_signature_expiration=-10))
seen["download_tampered"] = fetch(
    alice.download_url("/home/user/signed.txt").replace("signed.txt", "other.txt"))
upload = alice.upload_url("/home/user/uploaded.txt")
r = httpx.post(upload, files={"file": ("chosen-by-client.txt", b"uploaded\n")})
seen["upload"] = [r.status_code, alice.files.read("/home/user/uploaded.txt"),
                  alice.files.exists("/home/user/chosen-by-client.txt")]

children = alice.fork(count=2)
seen["forks"] = len(children)
seen["fork_ids_differ"] = len({c.sandbox_id for c in children} | {alice.sandbox_id}) == 3
seen["fork_state"] = [c.run_code("x + 1").text for c in children]
children[0].run_code("x = 0")
seen["fork_isolated"] = [alice.run_code("x").text, children[1].run_code("x").text]
mine |= {c.sandbox_id for c in children}
seen["fork_listed"] = len(listed(SandboxQuery(metadata={"user": "alice"}))[0])


async def async_part():
    """The control plane through the async SDK: a listing by metadata, metrics, signed
    download and upload URLs, gzip bodies, a fork that keeps the parent's state, connect by
    id."""
    a = await AsyncSandbox.create(template="base", timeout=1800, metadata={"user": "async"})
    ids = [s.sandbox_id for s in await AsyncSandbox.list(
        query=SandboxQuery(metadata={"user": "async"})).next_items()]
    metrics = await a.get_metrics()
    await a.files.write("/home/user/a.txt", "async\n")
    got = fetch(a.download_url("/home/user/a.txt"))
    async with httpx.AsyncClient() as http:
        r = await http.post(a.upload_url("/home/user/up.txt"), files={"file": ("x", b"up\n")})
    up = [r.status_code, await a.files.read("/home/user/up.txt")]
    await a.files.write("/home/user/z.txt", "gz " * 100, gzip=True)
    gz = await a.files.read("/home/user/z.txt", gzip=True) == "gz " * 100
    await a.run_code("y = 6")
    children = await a.fork(count=1)
    forked = [(await c.run_code("y * 7")).text for c in children]
    again = await AsyncSandbox.connect(a.sandbox_id)
    info = await again.get_info()
    for c in children:
        await c.kill()
    await a.kill()
    return [ids == [a.sandbox_id], len(metrics) > 0, got, up, gz, forked,
            info.sandbox_id == a.sandbox_id]


seen["async"] = asyncio.run(async_part())

for s in [alice, bob, *children]:
    s.kill()
seen["after_kill"] = listed()
print(json.dumps(seen))
