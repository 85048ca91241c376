//! Transactions (`KV/Txn`) and paginated reads at a fixed revision: what a store kept in etcd
//! needs beyond single puts.

use super::wire::{self, CompareResult, CompareTarget, TargetUnion};
use super::{Client, EtcdError, Kv};

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

fn compare(c: &Compare) -> wire::Compare {
    let (key, result, target, union) = match c {
        Compare::CreateRevision(key, rev) => {
            (key, CompareResult::Equal, CompareTarget::Create, TargetUnion::CreateRevision(*rev))
        }
        Compare::Value(key, value) => {
            (key, CompareResult::Equal, CompareTarget::Value, TargetUnion::Value(value.clone()))
        }
        Compare::ValueLess(key, value) => {
            (key, CompareResult::Less, CompareTarget::Value, TargetUnion::Value(value.clone()))
        }
    };
    wire::Compare { result: result as i32, target: target as i32, key: key.clone(), target_union: Some(union) }
}

fn op(o: &Op) -> wire::RequestOp {
    let request = match o {
        Op::Put { key, value, lease } => {
            wire::Request::Put(wire::PutRequest { key: key.clone(), value: value.clone(), lease: *lease })
        }
        Op::Delete(key) => wire::Request::DeleteRange(wire::DeleteRangeRequest { key: key.clone() }),
        Op::Get(key) => wire::Request::Range(wire::RangeRequest { key: key.clone(), ..Default::default() }),
    };
    wire::RequestOp { request: Some(request) }
}

impl Client {
    /// Runs `success` if every comparison in `guard` holds, else `failure`, atomically.
    pub async fn txn(&self, guard: &[Compare], success: &[Op], failure: &[Op]) -> Result<TxnResult, EtcdError> {
        let request = wire::TxnRequest {
            compare: guard.iter().map(compare).collect(),
            success: success.iter().map(op).collect(),
            failure: failure.iter().map(op).collect(),
        };
        let answer = self.call::<wire::TxnCall>(request).await?;
        let ran = if answer.succeeded { success } else { failure };
        // An operation etcd gave no answer for reads nothing.
        let responses = answer.responses.into_iter().map(Some).chain(std::iter::repeat_with(|| None));
        let mut ranges = Vec::new();
        for (o, response) in ran.iter().zip(responses) {
            if let Op::Get(_) = o {
                let kv = match response.and_then(|r| r.response) {
                    Some(wire::Response::Range(range)) => range.kvs.into_iter().next(),
                    None => None,
                };
                ranges.push(kv.map(Kv::from));
            }
        }
        Ok(TxnResult { succeeded: answer.succeeded, revision: wire::revision(answer.header.as_ref()), ranges })
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.txn(&[], &[Op::Delete(key.to_vec())], &[]).await.map(drop)
    }

    /// At most `limit` keys of `[key, range_end)`, at `revision` (0: the newest), linearizable.
    /// Reading page after page at the first page's revision gives one consistent image of a
    /// range too large for one answer.
    pub async fn range_page(&self, key: &[u8], range_end: &[u8], limit: i64, revision: i64) -> Result<Page, EtcdError> {
        let request = wire::RangeRequest { key: key.to_vec(), range_end: range_end.to_vec(), limit, revision };
        let answer = self.call::<wire::RangeCall>(request).await?;
        let kvs = answer.kvs.into_iter().map(Kv::from).collect();
        Ok(Page { kvs, revision: wire::revision(answer.header.as_ref()), more: answer.more })
    }
}
