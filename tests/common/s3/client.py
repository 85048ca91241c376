"""boto3 through fencegate, as an S3 user would drive it: each scenario is one trace of lock
holders writing, judged by what the S3 server holds afterwards (read from the server
directly). Run by tests/proxy/s3.rs; exits non-zero with the failed assertion.

    client.py setup MOTO_URL                      -> prints "ACCESS_KEY SECRET"
    client.py SCENARIO SERVER FENCEGATE_URL SERVER_URL ACCESS_KEY SECRET

SERVER is `moto` or `s3s` (s3s-fs): each has quirks of its own, which the scenarios say where
they meet them.
"""

import io
import json
import os
import socket
import sys
import time
from urllib.parse import urlparse

import boto3
import botocore
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

TOKEN_HEADER = "Fencing-Token"
# Virtual-host style names the bucket in the host: bk1.s3.test. Names under .test resolve to
# loopback here, so no DNS is needed; fencegate is configured with the suffix s3.test.
VIRTUAL_SUFFIX = "s3.test"
_resolve = socket.getaddrinfo


def _loopback_for_test_names(host, *args, **kwargs):
    if isinstance(host, str) and host.endswith(".test"):
        host = "127.0.0.1"
    return _resolve(host, *args, **kwargs)


socket.getaddrinfo = _loopback_for_test_names


def setup(moto):
    """An IAM user allowed everything, made in the server's unauthenticated first actions."""
    iam = boto3.client("iam", endpoint_url=moto, region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="fencegate")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="fencegate", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="fencegate")["AccessKey"]
    print(key["AccessKeyId"], key["SecretAccessKey"])


class World:
    def __init__(self, server, fencegate, url, access_key, secret):
        self.server, self.fencegate, self.url = server, fencegate, url
        self.access_key, self.secret = access_key, secret
        self.sent = []

    def client(self, token=None, endpoint=None, secret=None, style="path"):
        """An S3 client that sends `token` on every request, signed with the rest, as a user
        adds it: a handler on the SDK's before-sign event. No retries: each call is one
        request, so a refusal is seen as sent. With `style="virtual"`, the bucket is in the
        host (bk1.s3.test:PORT, resolved to fencegate)."""
        endpoint = endpoint or self.fencegate
        if style == "virtual":
            endpoint = f"http://{VIRTUAL_SUFFIX}:{urlparse(endpoint).port}"
        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=secret or self.secret,
            config=Config(retries={"max_attempts": 1, "mode": "standard"}, s3={"addressing_style": style}))

        def add_token(request, **_):
            if token is not None:
                request.headers[TOKEN_HEADER] = str(token)
            self.sent.append((request.method, request.url))

        client.meta.events.register("before-sign.s3.*", add_token)
        return client

    def direct(self):
        """The S3 server itself, around fencegate: what it holds. Its answers' checksums are
        not checked: s3s-fs answers a completed multipart upload with its last part's."""
        client = self.client(endpoint=self.url)
        client.meta.config.response_checksum_validation = "when_required"
        return client

    def body(self, bucket, key):
        try:
            return self.direct().get_object(Bucket=bucket, Key=key)["Body"].read()
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] == "NoSuchKey":
                return None
            raise

    def keys(self, bucket):
        listed = self.direct().list_objects_v2(Bucket=bucket)
        return sorted(o["Key"] for o in listed.get("Contents", []))


def refused(call):
    """The S3 error code and status of a call that must fail."""
    try:
        call()
    except botocore.exceptions.ClientError as e:
        return e.response["Error"]["Code"], e.response["ResponseMetadata"]["HTTPStatusCode"]
    raise AssertionError("the call succeeded")


def check(got, want, what):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def zombie(w):
    """The seed trace: holder 34 writes, the paused holder 33 wakes and writes; the SDK reads
    fencegate's refusal as an S3 error with its own code, and does not retry a 409."""
    w.client(1).create_bucket(Bucket="locks")
    w.client(34).put_object(Bucket="locks", Key="data", Body=b"from 34")
    sent = len(w.sent)
    check(refused(lambda: w.client(33).put_object(Bucket="locks", Key="data", Body=b"from 33")),
          ("StaleToken", 409), "the zombie's write")
    check(len(w.sent) - sent, 1, "requests the SDK sent for one refused write")
    check(w.body("locks", "data"), b"from 34", "the object")
    check(refused(lambda: w.client(None).put_object(Bucket="locks", Key="data", Body=b"none")),
          ("MissingToken", 428), "a write without a token")


def signatures(w):
    """Keys that a path normaliser would rewrite reach the server as signed, and name
    distinct objects: fencegate forwards the client's bytes and keys them as S3 does."""
    w.client(1).create_bucket(Bucket="sig")
    if w.server == "moto":
        # moto refuses keys with spaces, %, non-ASCII or sub-delimiters even sent to it
        # directly: it checks them against its own decoded path.
        odd = ["a//b", "a/./b", "a/../b", "a/b", "q?uery#frag", "d/"]
    else:
        # s3s-fs stores objects as files: a//b, a/./b and a/../b are its file a/b or b, so
        # fencegate refuses them there (s3.flat_keys = false), and keys with %, + and the like
        # are files of their own.
        odd = ["a/b", "q?uery#frag", "sp ace+plus", "sp ace plus", "caf\u00e9", "p%41ct", "pAct", "a%2Fb",
               "!'()*~$&,;=@", "new\nline"]
        for alias in ["a//b", "a/./b", "x/../a/b"]:
            check(refused(lambda: w.client(90).put_object(Bucket="sig", Key=alias, Body=b"alias")),
                  ("InvalidRequest", 400), f"{alias!r}, another key's file")
    for i, key in enumerate(odd):
        w.client(10 + i).put_object(Bucket="sig", Key=key, Body=key.encode())
    if w.server == "moto":
        # s3s-fs lists keys decoded once more than it stores them.
        check(w.keys("sig"), sorted(odd), "the server's keys")
    for key in odd:
        check(w.body("sig", key), key.encode(), key)
    # Distinct keys, distinct fences.
    first = odd[0]
    check(refused(lambda: w.client(9).put_object(Bucket="sig", Key=first, Body=b"old")),
          ("StaleToken", 409), f"{first}'s fence")
    w.client(30).put_object(Bucket="sig", Key="q?uery#frag", Body=b"30")
    check(refused(lambda: w.client(29).put_object(Bucket="sig", Key="q?uery#frag", Body=b"29")),
          ("StaleToken", 409), "q?uery#frag's fence")
    w.client(29).put_object(Bucket="sig", Key=odd[-1], Body=b"29 on the last")
    # The server checks signatures: a wrong secret is refused by it, through fencegate.
    check(refused(lambda: w.client(50, secret="wrong").put_object(Bucket="sig", Key="x", Body=b"x")),
          ("SignatureDoesNotMatch", 403), "a bad signature")


def overtaken_upload(w, bucket):
    """Holder 41's upload of `bucket`/k with one part, then holder 42's PutObject of k: the
    client of 41, the upload id, and the parts a completion names."""
    old = w.client(41)
    upload = old.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    part = old.upload_part(Bucket=bucket, Key="k", UploadId=upload, PartNumber=1, Body=b"old part")
    w.client(42).put_object(Bucket=bucket, Key="k", Body=b"from 42")
    return old, upload, {"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]}


def multipart(w):
    """A multipart upload is one write: a holder overtaken mid-upload cannot complete it."""
    w.client(1).create_bucket(Bucket="mpu")
    big = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    w.client(40).upload_fileobj(io.BytesIO(b"4" * (6 << 20)), "mpu", "whole", Config=big)
    check(len(w.body("mpu", "whole")), 6 << 20, "a whole upload")
    old, upload, parts = overtaken_upload(w, "mpu")
    check(refused(lambda: old.upload_part(Bucket="mpu", Key="k", UploadId=upload, PartNumber=2, Body=b"more")),
          ("StaleToken", 409), "a part after the key moved on")
    check(refused(lambda: old.complete_multipart_upload(Bucket="mpu", Key="k", UploadId=upload,
                                                        MultipartUpload=parts)),
          ("StaleToken", 409), "the overtaken completion")
    check(w.body("mpu", "k"), b"from 42", "the object")


def decoys(w):
    """An upload id leads where it was created, whatever key a request names: S3 servers find
    an upload by its id alone. So a part, completion or abort is checked against the key and
    token the upload was created with, and a stale holder gains nothing by naming a decoy key
    whose fence it would pass."""
    w.client(1).create_bucket(Bucket="dec")
    old, upload, parts = overtaken_upload(w, "dec")
    # Under a key no one fenced, the stale token is fresh: the id is what must not pass.
    check(refused(lambda: old.upload_part(Bucket="dec", Key="decoy", UploadId=upload, PartNumber=2, Body=b"x")),
          ("NoSuchUpload", 404), "a part sent under a decoy key")
    check(refused(lambda: old.complete_multipart_upload(Bucket="dec", Key="decoy", UploadId=upload,
                                                        MultipartUpload=parts)),
          ("NoSuchUpload", 404), "the overtaken completion under a decoy key")
    check(w.body("dec", "k"), b"from 42", "the object the upload was created for")
    check(w.body("dec", "decoy"), None, "the decoy key")
    # The newer holder's upload: the stale holder cannot abort it from a decoy, nor anyone
    # complete it with another token.
    new = w.client(43)
    mine = new.create_multipart_upload(Bucket="dec", Key="k")["UploadId"]
    part = new.upload_part(Bucket="dec", Key="k", UploadId=mine, PartNumber=1, Body=b"43's part")
    parts = {"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]}
    check(refused(lambda: old.abort_multipart_upload(Bucket="dec", Key="decoy", UploadId=mine)),
          ("NoSuchUpload", 404), "an abort of another's upload under a decoy key")
    check(refused(lambda: w.client(44).complete_multipart_upload(Bucket="dec", Key="k", UploadId=mine,
                                                                 MultipartUpload=parts)),
          ("UploadToken", 409), "a completion with another token than the upload's")
    new.complete_multipart_upload(Bucket="dec", Key="k", UploadId=mine, MultipartUpload=parts)
    check(w.body("dec", "k"), b"43's part", "the completed upload")
    # An upload created around fencegate is not one it can vouch for.
    around = w.direct().create_multipart_upload(Bucket="dec", Key="k")["UploadId"]
    check(refused(lambda: w.client(50).upload_part(Bucket="dec", Key="k", UploadId=around, PartNumber=1,
                                                   Body=b"x")),
          ("NoSuchUpload", 404), "a part of an upload fencegate did not create")


def uploads_before_kill(w):
    """Before a kill -9: an upload whose holder is then overtaken, and one whose holder is not,
    each with a part; what the second half needs goes to the file $FG_S3_STATE."""
    w.client(1).create_bucket(Bucket="crash")
    old = w.client(41)
    overtaken = old.create_multipart_upload(Bucket="crash", Key="k")["UploadId"]
    part = old.upload_part(Bucket="crash", Key="k", UploadId=overtaken, PartNumber=1, Body=b"41's part")
    w.client(42).put_object(Bucket="crash", Key="k", Body=b"from 42")
    live = w.client(43).create_multipart_upload(Bucket="crash", Key="j")["UploadId"]
    live_part = w.client(43).upload_part(Bucket="crash", Key="j", UploadId=live, PartNumber=1, Body=b"43's part")
    # The part's answer reaches the fence log lazily (within 200 ms), and a kill before that
    # quarantines j after the restart. A write to another key carries it: its advance is made
    # durable with the answers before it.
    w.client(2).put_object(Bucket="crash", Key="flush", Body=b"")
    with open(os.environ["FG_S3_STATE"], "w") as f:
        json.dump({"overtaken": [overtaken, part["ETag"]], "live": [live, live_part["ETag"]]}, f)


def uploads_after_kill(w):
    """After the kill and a restart on the same data dir: the overtaken upload completes neither
    under its key nor under a decoy, and the other upload, whose binding survived, completes."""
    with open(os.environ["FG_S3_STATE"]) as f:
        state = json.load(f)
    upload, etag = state["overtaken"]
    parts = {"Parts": [{"ETag": etag, "PartNumber": 1}]}
    old = w.client(41)
    for key, want in [("k", ("StaleToken", 409)), ("decoy", ("NoSuchUpload", 404))]:
        check(refused(lambda: old.complete_multipart_upload(Bucket="crash", Key=key, UploadId=upload,
                                                            MultipartUpload=parts)),
              want, f"the overtaken upload completed under {key}")
    check(w.body("crash", "k"), b"from 42", "the object the overtaken upload was for")
    check(w.body("crash", "decoy"), None, "the decoy key")
    upload, etag = state["live"]
    w.client(43).complete_multipart_upload(Bucket="crash", Key="j", UploadId=upload,
                                           MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]})
    check(w.body("crash", "j"), b"43's part", "the upload whose holder was not overtaken")


def journal(event):
    """Appends one line to the journal $FG_S3_STATE, flushed at once: a kill -9 of fencegate
    may come at any moment, and what was answered before it must be known."""
    with open(os.environ["FG_S3_STATE"], "a") as f:
        f.write(json.dumps(event) + "\n")


def uploads_under_load(w):
    """Uploads and the writes that overtake them, one after another over a few keys, until
    fencegate is killed (a refused connection ends the run). Tokens start at $FG_S3_BASE."""
    base = int(os.environ["FG_S3_BASE"])
    bucket = "kill"
    try:
        w.client(1).create_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError:
        pass  # made in an earlier round
    except Exception:
        return
    try:
        for step in range(10_000):
            key, token = f"b{base}-k{step % 3}", base + 2 * step + 1
            holder = w.client(token)
            journal({"op": "create", "key": key, "token": token})
            upload = holder.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            body = f"{token}'s part".encode()
            part = holder.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
            journal({"op": "upload", "key": key, "token": token, "id": upload, "etag": part["ETag"]})
            if step % 2:
                # Overtaken: a newer holder writes the object. Sent is noted before it goes.
                journal({"op": "sent", "key": key, "token": token + 1})
                w.client(token + 1).put_object(Bucket=bucket, Key=key, Body=f"{token + 1}".encode())
                journal({"op": "acked", "key": key, "token": token + 1})
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError, OSError):
        return  # fencegate was killed, or refused a resource quarantined by an earlier kill


def uploads_after_load(w):
    """After the kill and a restart: no upload whose object a newer write was acknowledged for
    completes, under its key or a decoy; one no newer write was even sent for completes."""
    events = [json.loads(line) for line in open(os.environ["FG_S3_STATE"])]
    # A newer holder's write that was answered (a PutObject, or a creation whose id came back)
    # overtook the uploads below its token; one that was sent may have.
    acked, sent = {}, {}
    for e in events:
        table = acked if e["op"] in ("acked", "upload") else sent
        table[e["key"]] = max(table.get(e["key"], 0), e["token"])
    uploads = [e for e in events if e["op"] == "upload"]
    completed = 0
    for u in uploads:
        key, token = u["key"], u["token"]
        parts = {"Parts": [{"ETag": u["etag"], "PartNumber": 1}]}
        holder = w.client(token)

        def complete(name):
            return holder.complete_multipart_upload(Bucket="kill", Key=name, UploadId=u["id"], MultipartUpload=parts)

        check(refused(lambda: complete(f"{key}-decoy"))[1], 404, f"{key} {token}: a completion under a decoy")
        overtaken = acked.get(key, 0) > token
        maybe = sent.get(key, 0) > token
        for attempt in range(40):
            try:
                complete(key)
                outcome = "completed"
            except botocore.exceptions.ClientError as e:
                outcome = e.response["Error"]["Code"]
                if outcome == "SlowDown":  # quarantined after the kill: its time passes
                    time.sleep(0.25)
                    continue
            break
        if overtaken:
            check(outcome != "completed", True, f"{key}: the upload of {token}, overtaken, completed")
        elif not maybe:
            check(outcome, "completed", f"{key}: the upload of {token}, which nothing overtook")
        completed += outcome == "completed"
    print(f"{len(uploads)} uploads, {completed} completed")


def copies(w):
    """A copy fences its destination, never its source: a low token may copy from a fenced
    object, and a stale one may not copy onto one."""
    w.client(1).create_bucket(Bucket="cpy")
    w.client(60).put_object(Bucket="cpy", Key="src", Body=b"source")
    w.client(5).copy_object(Bucket="cpy", Key="mine", CopySource={"Bucket": "cpy", "Key": "src"})
    check(w.body("cpy", "mine"), b"source", "a copy from a fenced object")
    w.client(70).put_object(Bucket="cpy", Key="dst", Body=b"70")
    check(refused(lambda: w.client(61).copy_object(Bucket="cpy", Key="dst", CopySource={"Bucket": "cpy", "Key": "src"})),
          ("StaleToken", 409), "a stale copy")
    check(w.body("cpy", "dst"), b"70", "the destination")


def batch_delete(w):
    """DeleteObjects changes the objects its body names, each fenced: a batch with one stale key
    deletes nothing, and a fresh one fences only the keys it names."""
    w.client(1).create_bucket(Bucket="del")
    w.client(80).put_object(Bucket="del", Key="a", Body=b"a")
    w.client(81).put_object(Bucket="del", Key="b", Body=b"b")
    objects = {"Objects": [{"Key": "a"}, {"Key": "b"}]}
    check(refused(lambda: w.client(80).delete_objects(Bucket="del", Delete=objects)), ("StaleToken", 409),
          "a batch with a stale key")
    check(w.keys("del"), ["a", "b"], "the bucket after a stale batch")
    w.client(90).delete_objects(Bucket="del", Delete=objects)
    check(w.keys("del"), [], "the bucket after a fresh batch")
    # The batch fenced the keys it named, not the bucket: another key's holder writes on.
    w.client(50).put_object(Bucket="del", Key="c", Body=b"c")
    check(refused(lambda: w.client(89).put_object(Bucket="del", Key="a", Body=b"a")), ("StaleToken", 409),
          "a key the batch deleted")
    check(w.keys("del"), ["c"], "the bucket at the end")


def styles(w):
    """Path style and virtual-host style name one object, and share its fence."""
    w.client(1).create_bucket(Bucket="styles")
    w.client(50).put_object(Bucket="styles", Key="k", Body=b"50 by path")
    virtual = lambda token: w.client(token, style="virtual")
    check(refused(lambda: virtual(49).put_object(Bucket="styles", Key="k", Body=b"49")), ("StaleToken", 409),
          "a stale write by virtual host")
    virtual(51).put_object(Bucket="styles", Key="k", Body=b"51 by host")
    check(refused(lambda: w.client(51).put_object(Bucket="styles", Key="k", Body=b"51")), ("StaleToken", 409),
          "an equal write by path")
    check(w.body("styles", "k"), b"51 by host", "the object")
    check(virtual(None).get_object(Bucket="styles", Key="k")["Body"].read(), b"51 by host", "a read by host")


def replay(w, trace, bucket, stale_key):
    """Runs `trace` (writer, token, key) twice: on the bare server, where the stale writer's
    last write lands, and through fencegate under one scope for the database's prefix, where it
    is refused and never reaches the server."""
    direct = w.direct()
    direct.create_bucket(Bucket="bare-" + bucket)
    for _, _, key in trace:
        direct.put_object(Bucket="bare-" + bucket, Key=key, Body=key.encode())
    check(w.body("bare-" + bucket, stale_key), stale_key.encode(), "the bare server took the stale write")
    w.client(1).create_bucket(Bucket=bucket)
    for writer, token, key in trace[:-1]:
        w.client(token).put_object(Bucket=bucket, Key=key, Body=writer.encode())
    writer, token, key = trace[-1]
    check(refused(lambda: w.client(token).put_object(Bucket=bucket, Key=key, Body=writer.encode())),
          ("StaleToken", 409), f"{writer}'s write after it was fenced")
    check(w.body(bucket, key), None, "the stale write through fencegate")


def slatedb_352(w):
    """SlateDB #352: writer 1 writes its WAL and manifest; writer 2 opens the database, which
    fences writer 1 by writing a new manifest; writer 1, a zombie, writes one more WAL object
    and acknowledges it. With the database's prefix one fence (a scope), the newer manifest
    write raises it, and the zombie's new object, a key never written, is refused."""
    replay(w, [
        ("writer 1", 11, "db/wal/00000000000000000001.sst"),
        ("writer 1", 11, "db/manifest/00000000000000000001.manifest"),
        ("writer 2", 12, "db/manifest/00000000000000000002.manifest"),
        ("writer 1", 11, "db/wal/00000000000000000002.sst"),
    ], "slatedb", "db/wal/00000000000000000002.sst")


def lance_6432(w):
    """Lance #6432: a writer fenced by a newer one kept writing WAL entries with plain puts.
    Each writer writes several entries under one token (equal tokens accepted under the
    prefix); the fenced one's next entry is refused."""
    replay(w, [
        ("writer A", 21, "db/_wal/0001.json"),
        ("writer A", 21, "db/_wal/0002.json"),
        ("writer B", 22, "db/_wal/0003.json"),
        ("writer A", 21, "db/_wal/0004.json"),
    ], "lance", "db/_wal/0004.json")


def transfers(w):
    """A body large enough for the SDK to send `Expect: 100-continue`, and a presigned URL (the
    signature in the query) with the token as an unsigned header, as a client without an SDK
    would send it."""
    import urllib.error
    import urllib.request
    w.client(1).create_bucket(Bucket="xfer")
    big = b"b" * (2 << 20)
    w.client(10).put_object(Bucket="xfer", Key="big", Body=big)
    check(w.body("xfer", "big"), big, "a 2 MiB object")
    check(refused(lambda: w.client(9).put_object(Bucket="xfer", Key="big", Body=big)), ("StaleToken", 409),
          "a stale 2 MiB write")
    if w.server == "moto":
        # moto's signature check reads the Authorization header only: a presigned URL is a 500
        # there, even sent to it directly.
        return
    signer = boto3.client("s3", endpoint_url=w.fencegate, region_name="us-east-1",
                          aws_access_key_id=w.access_key, aws_secret_access_key=w.secret,
                          config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
    url = signer.generate_presigned_url("put_object", Params={"Bucket": "xfer", "Key": "pre"}, ExpiresIn=300)

    def put(token, body):
        request = urllib.request.Request(url, data=body, method="PUT",
                                         headers={TOKEN_HEADER: str(token), "Content-Type": ""})
        try:
            return urllib.request.urlopen(request).status, b""
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    status, _ = put(20, b"fresh")
    check(status, 200, "a presigned write")
    status, body = put(19, b"stale")
    check((status, b"<Code>StaleToken</Code>" in body), (409, True), "a stale presigned write")
    check(w.body("xfer", "pre"), b"fresh", "the presigned object")


SCENARIOS = {f.__name__: f for f in [zombie, signatures, multipart, decoys, uploads_before_kill,
                                     uploads_after_kill, uploads_under_load, uploads_after_load, copies, batch_delete, styles, slatedb_352,
                                     lance_6432, transfers]}

if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(sys.argv[2])
    else:
        SCENARIOS[sys.argv[1]](World(*sys.argv[2:7]))
        print("ok")
