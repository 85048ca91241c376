"""How bodies travel, and a client other than boto3: boto3's aws-chunked bodies (over TLS, where
the SDK sends them), its `Expect: 100-continue`, and rclone, each fresh and stale, judged by
what the S3 server holds afterwards (read from it directly). Run by tests/proxy/s3_streams.rs,
which also reads what the server or fencegate received (tests/common/s3/tap.rs).

    streams.py SCENARIO SERVER FENCEGATE_URL SERVER_URL ACCESS_KEY SECRET [CA_FILE]
"""

import hashlib
import io
import os
import subprocess
import sys
import tempfile

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import TOKEN_HEADER, World, check, refused  # noqa: E402

# Markers the Rust side looks for in what the server received: a stale body must never be
# among it.
FRESH_CHUNKED = b"FRESH-CHUNKED-BODY"
STALE_CHUNKED = b"STALE-CHUNKED-BODY"
OVERTAKEN_PART = b"OVERTAKEN-PART-BODY"


def tls_client(w, token, ca):
    """boto3 as it is by default (botocore >= 1.36: `request_checksum_calculation` is
    `when_supported`), over https: PutObject and UploadPart of a file object then send the body
    aws-chunked (`Content-Encoding: aws-chunked`, `x-amz-content-sha256:
    STREAMING-UNSIGNED-PAYLOAD-TRAILER`, a CRC32 trailer after the last chunk). Over plain http
    the SDK signs the payload instead and sends no aws-chunked body."""
    client = boto3.client(
        "s3", endpoint_url=w.fencegate, region_name="us-east-1", verify=ca,
        aws_access_key_id=w.access_key, aws_secret_access_key=w.secret,
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, s3={"addressing_style": "path"},
                      request_checksum_calculation="when_supported"))
    client.meta.events.register("before-sign.s3.*",
                                lambda request, **_: request.headers.__setitem__(TOKEN_HEADER, str(token)))
    return client


def body_of(marker, size):
    return (marker * (size // len(marker) + 1))[:size]


def aws_chunked(w, ca):
    """A PutObject and a multipart upload with aws-chunked bodies of several chunks, fresh and
    stale, and a holder overtaken mid-upload whose next aws-chunked part is refused."""
    tls_client(w, 1, ca).create_bucket(Bucket="chunked")
    fresh = body_of(FRESH_CHUNKED, 3 << 20)
    tls_client(w, 10, ca).put_object(Bucket="chunked", Key="k", Body=io.BytesIO(fresh))
    check(w.body("chunked", "k"), fresh, "a fresh aws-chunked PutObject")
    check(refused(lambda: tls_client(w, 9, ca).put_object(Bucket="chunked", Key="k",
                                                        Body=io.BytesIO(body_of(STALE_CHUNKED, 3 << 20)))),
          ("StaleToken", 409), "a stale aws-chunked PutObject")
    check(w.body("chunked", "k"), fresh, "the object after a stale aws-chunked PutObject")

    # The SDK's managed transfer: a multipart upload whose parts are aws-chunked.
    big = body_of(b"MULTIPART-CHUNKED", 11 << 20)
    parts = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=2)
    tls_client(w, 20, ca).upload_fileobj(io.BytesIO(big), "chunked", "big", Config=parts)
    check(hashlib.sha256(w.body("chunked", "big")).hexdigest(), hashlib.sha256(big).hexdigest(),
          "a multipart upload of aws-chunked parts")

    old = tls_client(w, 30, ca)
    upload = old.create_multipart_upload(Bucket="chunked", Key="mpu")["UploadId"]
    first = body_of(b"FIRST-PART", 5 << 20)
    part = old.upload_part(Bucket="chunked", Key="mpu", UploadId=upload, PartNumber=1, Body=io.BytesIO(first))
    tls_client(w, 31, ca).put_object(Bucket="chunked", Key="mpu", Body=io.BytesIO(b"from 31"))
    check(refused(lambda: old.upload_part(Bucket="chunked", Key="mpu", UploadId=upload, PartNumber=2,
                                          Body=io.BytesIO(body_of(OVERTAKEN_PART, 1 << 20)))),
          ("StaleToken", 409), "an aws-chunked part after the key moved on")
    done = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    check(refused(lambda: old.complete_multipart_upload(Bucket="chunked", Key="mpu", UploadId=upload,
                                                        MultipartUpload=done)),
          ("StaleToken", 409), "the overtaken completion")
    check(w.body("chunked", "mpu"), b"from 31", "the object the newer holder wrote")


def expect_continue(w, _ca):
    """boto3 sends `Expect: 100-continue` with a file object for a body: a fresh write gets its
    100 and lands, a stale one gets fencegate's 409 instead of a 100, and the same client's next
    write, which its pool may send on the connection the refusal left, lands too."""
    w.client(1).create_bucket(Bucket="expect")
    w.client(1000).put_object(Bucket="expect", Key="k", Body=io.BytesIO(b"fresh 1000"))
    check(w.body("expect", "k"), b"fresh 1000", "a fresh write with Expect")
    for token in range(10, 30):
        client = w.client(token)
        client.put_object(Bucket="expect", Key="before", Body=io.BytesIO(b"before"))
        check(refused(lambda: client.put_object(Bucket="expect", Key="k", Body=io.BytesIO(b"STALE-EXPECT-BODY"))),
              ("StaleToken", 409), f"a stale write with Expect ({token})")
        client.put_object(Bucket="expect", Key="after", Body=io.BytesIO(f"after {token}".encode()))
    check(w.body("expect", "k"), b"fresh 1000", "the object after the stale writes")
    check(w.body("expect", "after"), b"after 29", "the writes after refusals")


def rclone(w, _ca):
    """rclone, configured as a user would (environment variables), with the token in
    `--header`: its S3 backend drops the headers of `--header-upload` it does not know ("Don't
    know how to set key"). `--s3-no-check-bucket`: rclone would otherwise create the bucket,
    a bucket write, fenced over the whole bucket; `--s3-no-head`: moto answers rclone's HEAD
    with `versionId=null` after an upload with 400, even sent to it directly."""
    w.client(1).create_bucket(Bucket="rclone")
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env.update({
        "RCLONE_CONFIG_FG_TYPE": "s3", "RCLONE_CONFIG_FG_PROVIDER": "Other",
        "RCLONE_CONFIG_FG_ENDPOINT": w.fencegate, "RCLONE_CONFIG_FG_REGION": "us-east-1",
        "RCLONE_CONFIG_FG_ACCESS_KEY_ID": w.access_key, "RCLONE_CONFIG_FG_SECRET_ACCESS_KEY": w.secret,
        "RCLONE_CONFIG_FG_FORCE_PATH_STYLE": "true",
    })
    tmp = tempfile.mkdtemp()

    def run(token, *args, option="--header"):
        cmd = ["rclone", "--config", "/dev/null", option, f"{TOKEN_HEADER}: {token}", "--s3-no-check-bucket",
               "--s3-no-head", "--retries", "1", "--low-level-retries", "1", "--s3-upload-cutoff", "5M",
               "--s3-chunk-size", "5M", *args]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        return out.returncode, out.stderr

    def local(name, body):
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(body)
        return path

    code, err = run(10, "copyto", local("fresh", b"fresh 10"), "fg:rclone/obj")
    check(code, 0, f"a fresh copy: {err}")
    check(w.body("rclone", "obj"), b"fresh 10", "a fresh copy")
    # The option rclone's docs offer for uploads sends no token to S3: the write is refused.
    code, err = run(50, "copyto", local("upload", b"header-upload 50"), "fg:rclone/obj", option="--header-upload")
    check((code != 0, "MissingToken" in err), (True, True), f"a copy with --header-upload: {err}")
    code, err = run(9, "copyto", local("stale", b"stale 9"), "fg:rclone/obj")
    check((code != 0, "StaleToken" in err), (True, True), f"a stale copy: {err}")
    check(w.body("rclone", "obj"), b"fresh 10", "the object after a stale copy")

    big = os.urandom(7 << 20)
    code, err = run(20, "copyto", local("big", big), "fg:rclone/big")
    check(code, 0, f"a fresh multipart copy: {err}")
    check(w.body("rclone", "big") == big, True, "a fresh multipart copy")
    code, err = run(19, "copyto", local("big-stale", os.urandom(7 << 20)), "fg:rclone/big")
    check((code != 0, "StaleToken" in err), (True, True), f"a stale multipart copy: {err}")
    check(w.body("rclone", "big") == big, True, "the object after a stale multipart copy")

    code, err = run(9, "deletefile", "fg:rclone/obj")
    check((code != 0, "StaleToken" in err), (True, True), f"a stale delete: {err}")
    check(w.body("rclone", "obj"), b"fresh 10", "the object after a stale delete")
    code, err = run(11, "deletefile", "fg:rclone/obj")
    check(code, 0, f"a fresh delete: {err}")
    check(w.body("rclone", "obj"), None, "the object after a fresh delete")


SCENARIOS = {f.__name__: f for f in [aws_chunked, expect_continue, rclone]}

if __name__ == "__main__":
    name, rest = sys.argv[1], sys.argv[2:]
    ca = rest[5] if len(rest) > 5 else None
    SCENARIOS[name](World(*rest[:5]), ca)
    print("ok")
