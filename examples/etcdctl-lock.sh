#!/bin/sh
# Takes an etcd lock with `etcdctl lock`, reads its fencing token, and sends one PUT through
# fencegate with that token while the lock is held; the lock is released when the PUT has
# been answered.
#
#   ETCDCTL_ENDPOINTS=127.0.0.1:2379 sh examples/etcdctl-lock.sh LOCK URL [CURL ARGS...]
#   sh examples/etcdctl-lock.sh accounts-42 http://127.0.0.1:8080/accounts/42 --data-binary 'balance=200'
#
# The token is the create revision of the holder's key, `ETCD_LOCK_KEY`, and not
# `ETCD_LOCK_REV` (the revision at which this holder got the lock, which is higher when it had
# to wait): every client of a lock must use the same one of the two, and the create revision
# is the one any client can read from the key. See docs/tokens.md.
#
# LOCK_TTL: the lock's session lease, in seconds (unset: etcdctl's default, 10). The response
# body goes to stdout, what happened to stderr. Exit status 0 for a 2xx answer, 1 otherwise.
set -eu

if [ "${1-}" = "--held" ]; then
  # Run by `etcdctl lock`, which exports ETCD_LOCK_KEY, while the lock is held.
  shift
  url=$1
  shift
  token=$(etcdctl get "$ETCD_LOCK_KEY" -w fields | sed -n 's/^"CreateRevision" : //p')
  if [ -z "$token" ]; then
    echo "$0: $ETCD_LOCK_KEY is gone: the lock's lease expired" >&2
    exit 1
  fi
  echo "$0: holding $ETCD_LOCK_KEY, fencing token $token" >&2
  body=$(mktemp)
  trap 'rm -f "$body"' EXIT
  status=$(curl -sS -o "$body" -w '%{http_code}' -X PUT "$url" -H "Fencing-Token: $token" "$@")
  cat "$body"
  echo "$0: PUT $url -> $status" >&2
  case $status in
    2??) exit 0 ;;
    *) exit 1 ;;
  esac
fi

if [ $# -lt 2 ]; then
  echo "usage: $0 LOCK URL [CURL ARGS...]" >&2
  exit 2
fi
lock=$1
shift
exec etcdctl lock --ttl "${LOCK_TTL:-10}" "$lock" -- sh "$0" --held "$@"
