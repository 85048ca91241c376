//! Transactions (`/v3/kv/txn`) and paginated reads at a fixed revision: what a store kept in
//! etcd needs beyond single puts.

use serde_json::{Value, json};

use super::wire::{RangeAnswer, TxnAnswer};
use super::{Client, EtcdError, Kv, b64};

/// One comparison of a transaction's guard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key's create revision equals this (0: the key does not exist).
    CreateRevision(Vec<u8>, i64),
    /// The key exists and its value equals this. etcd fails a value compare on a key that does
    /// not exist, whatever the value compared with.
    Value(Vec<u8>, Vec<u8>),
    /// The key exists and its value sorts (byte-wise) below this.
    ValueLess(Vec<u8>, Vec<u8>),
}

/// One operation of a transaction's branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Puts a value, attached to a lease (0: none).
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The lease, 0 for none.
        lease: i64,
    },
    /// Deletes one key.
    Delete(Vec<u8>),
    /// Reads one key (its answer is in [`TxnResult::ranges`]).
    Get(Vec<u8>),
}

/// What a transaction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether the guard held (the success branch ran).
    pub succeeded: bool,
    /// The revision after the transaction (the one it wrote at, if it wrote).
    pub revision: i64,
    /// For each [`Op::Get`] of the branch that ran, in order: the key read, if it exists.
    pub ranges: Vec<Option<Kv>>,
}

/// One page of a range read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The keys, in key order.
    pub kvs: Vec<Kv>,
    /// The revision the read saw.
    pub revision: i64,
    /// Whether keys beyond this page remain in the range.
    pub more: bool,
}

fn compare(c: &Compare) -> Value {
    match c {
        Compare::CreateRevision(key, rev) => {
            json!({ "key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": rev.to_string() })
        }
        Compare::Value(key, value) => {
            json!({ "key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value) })
        }
        Compare::ValueLess(key, value) => {
            json!({ "key": b64(key), "target": "VALUE", "result": "LESS", "value": b64(value) })
        }
    }
}

fn op(o: &Op) -> Value {
    match o {
        Op::Put { key, value, lease } => {
            let mut put = json!({ "key": b64(key), "value": b64(value) });
            if *lease != 0 {
                put["lease"] = Value::String(lease.to_string());
            }
            json!({ "request_put": put })
        }
        Op::Delete(key) => json!({ "request_delete_range": { "key": b64(key) } }),
        Op::Get(key) => json!({ "request_range": { "key": b64(key) } }),
    }
}

impl Client {
    /// Runs `success` if every comparison in `guard` holds, else `failure`, atomically.
    pub async fn txn(&self, guard: &[Compare], success: &[Op], failure: &[Op]) -> Result<TxnResult, EtcdError> {
        let body = json!({
            "compare": guard.iter().map(compare).collect::<Vec<_>>(),
            "success": success.iter().map(op).collect::<Vec<_>>(),
            "failure": failure.iter().map(op).collect::<Vec<_>>(),
        });
        let answer: TxnAnswer = self.call("/v3/kv/txn", body).await?;
        let ran = if answer.succeeded { success } else { failure };
        // An operation etcd gave no answer for reads nothing.
        let responses = answer.responses.into_iter().map(Some).chain(std::iter::repeat_with(|| None));
        let mut ranges = Vec::new();
        for (o, response) in ran.iter().zip(responses) {
            if let Op::Get(_) = o {
                let kv = response.and_then(|r| r.response_range).and_then(|r| r.kvs.into_iter().next());
                ranges.push(kv.map(Kv::from));
            }
        }
        Ok(TxnResult { succeeded: answer.succeeded, revision: answer.header.revision, ranges })
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.txn(&[], &[Op::Delete(key.to_vec())], &[]).await.map(drop)
    }

    /// At most `limit` keys of `[key, range_end)`, at `revision` (0: the newest), linearizable.
    /// Reading page after page at the first page's revision gives one consistent image of a
    /// range too large for one answer.
    pub async fn range_page(&self, key: &[u8], range_end: &[u8], limit: i64, revision: i64) -> Result<Page, EtcdError> {
        let mut body = json!({ "key": b64(key), "range_end": b64(range_end), "limit": limit.to_string() });
        if revision != 0 {
            body["revision"] = Value::String(revision.to_string());
        }
        let answer: RangeAnswer = self.call("/v3/kv/range", body).await?;
        let kvs = answer.kvs.into_iter().map(Kv::from).collect();
        Ok(Page { kvs, revision: answer.header.revision, more: answer.more })
    }
}
