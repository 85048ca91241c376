"""Random mixes of S3 writes from several lock holders, sent through fencegate with boto3 and
checked against a model of what fencing allows. Run by tests/proxy/s3_model.rs.

    mix.py SERVER FENCEGATE_URL SERVER_URL ACCESS_KEY SECRET SEED ROUNDS [bare]

Each round is one program drawn from `random.Random(f"{SEED}/{round}")` over four keys of its
own: holders arrive with climbing tokens and keep writing after newer ones arrive (zombies),
with PutObject, DeleteObject, DeleteObjects, CopyObject and multipart uploads (create, parts,
complete, abort) whose steps interleave with everyone else's writes, so holders are overtaken
mid-upload. The model is the fence's rule: a write passes if its token is above the `max_seen`
of every key it names (equal passes in the bucket `mixeq`, whose fence accepts equal tokens;
a part, completion or abort passes at the token its upload was created with), and an object
holds the last write that passed. Every answer is checked against the model as it is sent, and
at the end of the round the server's own record (a listing of the round's prefix and a GET of
every key, read from the server directly) against the model's objects.

With `bare` the same programs go to the server directly, around fencegate: stale writes land,
and the checks say so (tests/proxy/s3_model.rs shows that they do). Exits 1 with the seed,
the round's program and what differed.
"""

import hashlib
import os
import random
import sys

import boto3
import botocore
from botocore.config import Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import World  # noqa: E402  (also resolves *.test names to loopback)

KEYS = ["k0", "k1", "d/k2", "e/k3"]
# The token every round's bucket was created with: a bucket write fences the whole bucket, so
# it is the floor of every key in it.
FLOOR = 1
# A part before the last must be at least 5 MiB (moto checks it on completion).
MIN_PART = 5 << 20
OPS_PER_ROUND = 40


def digest(body):
    if body is None:
        return None
    return f"{len(body)} bytes {hashlib.sha256(body).hexdigest()[:12]} {body[:24]!r}"


class Model:
    """What fencing allows: each key's `max_seen` and the object the last passing write left."""

    def __init__(self, keys, equal_accept):
        self.max_seen = {k: FLOOR for k in keys}
        self.objects = {k: None for k in keys}
        self.equal_accept = equal_accept

    def passes(self, token, keys, upload=False):
        return all(token > self.max_seen[k] or (token == self.max_seen[k] and (upload or self.equal_accept))
                   for k in keys)

    def advance(self, token, keys):
        for k in keys:
            self.max_seen[k] = max(self.max_seen[k], token)


def outcome(call):
    """`ok` with the call's result, `stale` for fencegate's refusal, or `error:Code`."""
    try:
        return "ok", call()
    except botocore.exceptions.ClientError as e:
        code = e.response["Error"]["Code"]
        status = e.response["ResponseMetadata"]["HTTPStatusCode"]
        if (code, status) == ("StaleToken", 409):
            return "stale", None
        return f"error:{code}", None


class Round:
    def __init__(self, w, seed, number, bare):
        self.w, self.bare = w, bare
        self.rng = random.Random(f"{seed}/{number}")
        self.equal_accept = self.rng.random() < 0.5
        self.bucket = "mixeq" if self.equal_accept else "mix"
        self.prefix = f"r{number}/"
        self.keys = [self.prefix + k for k in KEYS]
        self.model = Model(self.keys, self.equal_accept)
        self.clients = {}
        self.holders, self.token = [], FLOOR
        self.uploads = []
        self.trace, self.mismatches = [], []
        self.counts = {}

    def client(self, token):
        if token not in self.clients:
            self.clients[token] = self.w.client(token, endpoint=self.w.url if self.bare else None)
        return self.clients[token]

    def expect(self, what, want, got):
        """Records the op and its answer, and a mismatch if the answer is not the model's."""
        self.trace.append(f"{len(self.trace)}: {what}: {got}")
        kind = what.split(" ")[0]
        passed = "stale" if got == "stale" else "passed"
        self.counts[(kind, passed)] = self.counts.get((kind, passed), 0) + 1
        if got not in want:
            self.mismatches.append(f"op {len(self.trace) - 1} {what}: answered {got}, the model says {' or '.join(want)}")

    def holder(self):
        if not self.holders or self.rng.random() < 0.2:
            self.token += self.rng.randint(1, 3)
            self.holders.append(self.token)
        # Mostly the newest holder; often a zombie.
        return self.holders[-1] if self.rng.random() < 0.5 else self.rng.choice(self.holders)

    def body(self, size=0):
        head = f"{self.prefix}op{len(self.trace)}@".encode()
        return head + b"x" * max(0, size - len(head)) if size else head + str(self.token).encode()

    def step(self):
        ops = [(self.put, 4), (self.delete, 2), (self.delete_objects, 1), (self.copy, 2), (self.create, 2)]
        if self.uploads:
            ops += [(self.part, 3), (self.complete, 3), (self.abort, 1)]
        op = self.rng.choices([f for f, _ in ops], weights=[w for _, w in ops])[0]
        op()

    def put(self):
        token, key, body = self.holder(), self.rng.choice(self.keys), self.body()
        passes = self.model.passes(token, [key])
        got, _ = outcome(lambda: self.client(token).put_object(Bucket=self.bucket, Key=key, Body=body))
        self.expect(f"PutObject {key} @{token}", ["ok"] if passes else ["stale"], got)
        if passes:
            self.model.advance(token, [key])
            self.model.objects[key] = body

    def delete(self):
        token, key = self.holder(), self.rng.choice(self.keys)
        passes = self.model.passes(token, [key])
        got, _ = outcome(lambda: self.client(token).delete_object(Bucket=self.bucket, Key=key))
        self.expect(f"DeleteObject {key} @{token}", ["ok"] if passes else ["stale"], got)
        if passes:
            self.model.advance(token, [key])
            self.model.objects[key] = None

    def delete_objects(self):
        token = self.holder()
        keys = self.rng.sample(self.keys, self.rng.randint(1, 3))
        passes = self.model.passes(token, keys)
        delete = {"Objects": [{"Key": k} for k in keys]}
        got, result = outcome(lambda: self.client(token).delete_objects(Bucket=self.bucket, Delete=delete))
        if got == "ok" and result.get("Errors"):
            got = f"error:{result['Errors'][0]['Code']}"
        self.expect(f"DeleteObjects {keys} @{token}", ["ok"] if passes else ["stale"], got)
        if passes:
            self.model.advance(token, keys)
            for k in keys:
                self.model.objects[k] = None

    def copy(self):
        token = self.holder()
        source, key = self.rng.sample(self.keys, 2)
        passes = self.model.passes(token, [key])
        copied = self.model.objects[source]
        got, _ = outcome(lambda: self.client(token).copy_object(
            Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": source}))
        # The fence passes a copy whose source is missing (it reads no source), and the server
        # then refuses it: the key's max_seen has climbed, its object is unchanged.
        want = ["stale"] if not passes else ["ok"] if copied is not None else ["error:NoSuchKey"]
        self.expect(f"CopyObject {source} -> {key} @{token}", want, got)
        if passes:
            self.model.advance(token, [key])
            if copied is not None:
                self.model.objects[key] = copied

    def create(self):
        token, key = self.holder(), self.rng.choice(self.keys)
        passes = self.model.passes(token, [key])
        got, result = outcome(lambda: self.client(token).create_multipart_upload(Bucket=self.bucket, Key=key))
        self.expect(f"CreateMultipartUpload {key} @{token}", ["ok"] if passes else ["stale"], got)
        if passes:
            self.model.advance(token, [key])
        if got == "ok":
            planned = 2 if self.rng.random() < 0.25 else 1
            self.uploads.append({"token": token, "key": key, "id": result["UploadId"], "planned": planned,
                                 "parts": [], "passes": passes})

    def upload(self):
        return self.rng.choice(self.uploads)

    def part(self, up=None):
        up = up or self.upload()
        number = len(up["parts"]) + 1
        if number > up["planned"]:
            return self.complete(up)
        token, key = up["token"], up["key"]
        body = self.body(MIN_PART if number < up["planned"] else 0)
        passes = up["passes"] and self.model.passes(token, [key], upload=True)
        got, result = outcome(lambda: self.client(token).upload_part(
            Bucket=self.bucket, Key=key, UploadId=up["id"], PartNumber=number, Body=body))
        self.expect(f"UploadPart {number} of {key} @{token}", ["ok"] if passes else ["stale"], got)
        if got == "ok":
            up["parts"].append({"PartNumber": number, "ETag": result["ETag"], "body": body})

    def complete(self, up=None):
        up = up or self.upload()
        if not up["parts"]:
            return self.part(up)
        token, key = up["token"], up["key"]
        passes = up["passes"] and self.model.passes(token, [key], upload=True)
        parts = {"Parts": [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in up["parts"]]}
        got, _ = outcome(lambda: self.client(token).complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=up["id"], MultipartUpload=parts))
        self.expect(f"CompleteMultipartUpload {key} ({len(up['parts'])} parts) @{token}",
                    ["ok"] if passes else ["stale"], got)
        if passes:
            self.model.objects[key] = b"".join(p["body"] for p in up["parts"])
        # An overtaken holder sometimes gives up; the others try again later.
        if got == "ok" or self.rng.random() < 0.5:
            self.uploads.remove(up)

    def abort(self):
        up = self.upload()
        token, key = up["token"], up["key"]
        passes = up["passes"] and self.model.passes(token, [key], upload=True)
        got, _ = outcome(lambda: self.client(token).abort_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=up["id"]))
        self.expect(f"AbortMultipartUpload {key} @{token}", ["ok"] if passes else ["stale"], got)
        if got == "ok" or self.rng.random() < 0.5:
            self.uploads.remove(up)

    def run(self):
        for _ in range(OPS_PER_ROUND):
            self.step()
        self.check_record()

    def check_record(self):
        """The server's own record of the round's keys against the model's objects."""
        # Listed whole and filtered here: moto's signature check fails on a `prefix` with a `/`.
        listed = sorted(k for k in self.w.keys(self.bucket) if k.startswith(self.prefix))
        want = sorted(k for k, body in self.model.objects.items() if body is not None)
        if listed != want:
            self.mismatches.append(f"the server holds the keys {listed}, the model {want}")
        # s3s-fs keeps the checksum of the object a multipart upload replaces, and serves it with
        # the new body (even sent to it directly): read without checking it.
        reader = boto3.client("s3", endpoint_url=self.w.url, region_name="us-east-1",
                              aws_access_key_id=self.w.access_key, aws_secret_access_key=self.w.secret,
                              config=Config(response_checksum_validation="when_required",
                                            s3={"addressing_style": "path"}))
        for key in self.keys:
            try:
                held = reader.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except reader.exceptions.NoSuchKey:
                held = None
            if held != self.model.objects[key]:
                self.mismatches.append(f"the server holds {key} as {digest(held)}, "
                                       f"the model as {digest(self.model.objects[key])}")


def main(server, fencegate, url, access_key, secret, seed, rounds, bare=None):
    w = World(server, fencegate, url, access_key, secret)
    bare = bare == "bare"
    setup = w.direct() if bare else w.client(FLOOR)
    for bucket in ["mix", "mixeq"]:
        setup.create_bucket(Bucket=bucket)
    totals = {}
    for number in range(int(rounds)):
        r = Round(w, seed, number, bare)
        r.run()
        for k, n in r.counts.items():
            totals[k] = totals.get(k, 0) + n
        if r.mismatches:
            print(f"seed {seed}, round {number} ({'equal tokens accepted' if r.equal_accept else 'equal refused'}), "
                  f"{'the bare server' if bare else 'through fencegate'} against {server}:")
            print("\n".join(r.trace))
            print("differed from the model:")
            print("\n".join(r.mismatches))
            sys.exit(1)
    summary = ", ".join(f"{kind} {n.get('passed', 0)}/{n.get('passed', 0) + n.get('stale', 0)}"
                        for kind, n in sorted(by_kind(totals).items()))
    print(f"seed {seed}: {rounds} rounds against {server}, passed/sent: {summary}")


def by_kind(totals):
    kinds = {}
    for (kind, passed), n in totals.items():
        kinds.setdefault(kind, {})[passed] = n
    return kinds


if __name__ == "__main__":
    main(*sys.argv[1:])
