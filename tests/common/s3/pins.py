"""Pinned writes in S3 mode (docs/s3.md#pins) driven by boto3: each scenario writes through
fencegate and around it (straight to the server), checks what the SDK was answered, and prints
the entity tags it saw as JSON, so that tests/proxy/s3_pins.rs can find in what the server
received (tests/common/s3/tap.rs) which precondition each write carried.

    pins.py SCENARIO SERVER FENCEGATE_URL SERVER_URL ACCESS_KEY SECRET
"""

import json
import os
import sys

import botocore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import World, check  # noqa: E402

BUCKET = "pins"


def refused(call):
    """The S3 error code, status and fencegate-error header of a call that must fail."""
    try:
        call()
    except botocore.exceptions.ClientError as e:
        meta = e.response["ResponseMetadata"]
        return e.response["Error"]["Code"], meta["HTTPStatusCode"], meta["HTTPHeaders"].get("fencegate-error")
    raise AssertionError("the call succeeded")


def put(w, token, key, body, **kwargs):
    return w.client(token).put_object(Bucket=BUCKET, Key=key, Body=body, **kwargs)["ETag"]


def preconditions(w):
    """A new object, learnt absent; a write pinned to the first; the client's own signed
    If-None-Match on the object, refused by fencegate; a write around fencegate, after which the
    next pinned write is BackendMoved and the one after it, learning the state anew, lands."""
    w.client(1).create_bucket(Bucket=BUCKET)
    first = put(w, 2, "k", b"first-body")
    second = put(w, 3, "k", b"second-body")
    check(refused(lambda: put(w, 4, "k", b"own-precondition-body", IfNoneMatch="*")),
          ("PreconditionFailed", 412, "precondition_failed"), "the client's own If-None-Match: *")
    around = w.direct().put_object(Bucket=BUCKET, Key="k", Body=b"around-body")["ETag"]
    check(refused(lambda: put(w, 5, "k", b"moved-body")), ("BackendMoved", 412, "backend_moved"),
          "the write after one around fencegate")
    check(w.body(BUCKET, "k"), b"around-body", "what the refused write left")
    after = put(w, 6, "k", b"after-body")
    check(w.body(BUCKET, "k"), b"after-body", "the write after the refused one")
    print(json.dumps({"first": first, "second": second, "around": around, "after": after}))


def before_restart(w):
    """A write through fencegate, then one around it, which fencegate does not see."""
    w.client(1).create_bucket(Bucket=BUCKET)
    through = put(w, 2, "r", b"through-body")
    around = w.direct().put_object(Bucket=BUCKET, Key="r", Body=b"around-restart-body")["ETag"]
    print(json.dumps({"through": through, "around": around}))


def after_restart(w):
    """After the restart, the next write lands: pinned to what a HEAD found."""
    after = put(w, 3, "r", b"after-restart-body")
    check(w.body(BUCKET, "r"), b"after-restart-body", "the write after the restart")
    print(json.dumps({"after": after}))


def completion(w):
    """A multipart upload of a new object, completed through fencegate, then a PutObject: the
    completion's answer names the object's tag in its body, which pins the write after it."""
    w.client(1).create_bucket(Bucket=BUCKET)
    c = w.client(7)
    upload = c.create_multipart_upload(Bucket=BUCKET, Key="m")["UploadId"]
    part = c.upload_part(Bucket=BUCKET, Key="m", UploadId=upload, PartNumber=1, Body=b"part-body")
    parts = {"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]}
    completed = c.complete_multipart_upload(Bucket=BUCKET, Key="m", UploadId=upload, MultipartUpload=parts)["ETag"]
    after = put(w, 8, "m", b"after-completion-body")
    check(w.body(BUCKET, "m"), b"after-completion-body", "the write after the completion")
    print(json.dumps({"completed": completed, "after": after}))


def deletes(w):
    """DeleteObject pinned where the server honours If-Match on it: a delete after a write
    around fencegate is BackendMoved, and the object stays."""
    w.client(1).create_bucket(Bucket=BUCKET)
    first = put(w, 2, "d", b"delete-me-body")
    w.client(3).delete_object(Bucket=BUCKET, Key="d")
    check(w.body(BUCKET, "d"), None, "the pinned delete")
    around = w.direct().put_object(Bucket=BUCKET, Key="d", Body=b"around-delete-body")["ETag"]
    # fencegate last saw the object absent: If-None-Match is no precondition on a delete, so it
    # goes as without pins, and deletes.
    w.client(4).delete_object(Bucket=BUCKET, Key="d")
    check(w.body(BUCKET, "d"), None, "the delete of an object last seen absent")
    second = put(w, 5, "d", b"second-body")
    w.direct().put_object(Bucket=BUCKET, Key="d", Body=b"around-again-body")
    check(refused(lambda: w.client(6).delete_object(Bucket=BUCKET, Key="d")),
          ("BackendMoved", 412, "backend_moved"), "the delete after a write around fencegate")
    check(w.body(BUCKET, "d"), b"around-again-body", "what the refused delete left")
    print(json.dumps({"first": first, "around": around, "second": second}))


def signed_conditions(w):
    """The client's own signed If-Match: exactly the pinned tag, it reaches the server as signed
    and lands; `*`, which fencegate would have to narrow to the tag (and so break the
    signature), is refused by fencegate with a reason, and nothing is sent."""
    w.client(1).create_bucket(Bucket=BUCKET)
    first = put(w, 2, "s", b"first-body")
    exact = put(w, 3, "s", b"exact-body", IfMatch=first)
    check(w.body(BUCKET, "s"), b"exact-body", "the write with the exact signed If-Match")
    check(refused(lambda: put(w, 4, "s", b"loose-body", IfMatch="*")),
          ("InvalidRequest", 400, "invalid_request"), "a signed If-Match: *")
    check(w.body(BUCKET, "s"), b"exact-body", "what the refused write left")
    print(json.dumps({"first": first, "exact": exact}))


SCENARIOS = {f.__name__: f for f in [preconditions, before_restart, after_restart, completion, deletes,
                                     signed_conditions]}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](World(*sys.argv[2:7]))
