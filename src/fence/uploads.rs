//! Bindings of multipart uploads: which object, and which token, each open upload was created
//! for. An S3-like server finds an upload by its id alone, whatever object a part or the
//! completion names, so the fence must know where an id leads: a binding is a mark of the
//! store ([`MarkKind::Upload`]) named by the object and the id, whose level is the token of
//! the write that created the upload. It is made durable before the creator hears the id, so
//! a restart keeps it; a part, completion or abort is refused unless the binding of the object
//! it names and the id it carries exists, with the token it carries. An id fencegate never
//! bound (lost, dropped, or created around it) is refused: that only costs the upload.
//!
//! Bindings are dropped when their upload ends, and bounded in number (`max_uploads`): when a
//! new upload is bound at the bound, the bindings that can never complete (a newer write raised
//! their object's key above their token) are dropped first, and if that leaves no room, the
//! bindings with the lowest tokens, the oldest uploads wherever tokens come from one counter
//! (etcd's revision, ZooKeeper's zxid), as abandoned uploads are. An upload whose binding was
//! dropped can take no more parts and cannot complete: it fails closed, and its holder starts over.
//! One the backend created is always bound, or its id would be refused.

use super::keys::{Scope, resource_key};
use super::tree::{Coverage, Touch};
use super::{EqualToken, Fence, FenceError};
use crate::store::{Mark, MarkBatch, MarkKind, MarkRef, StoreError};

/// Separates the object from the upload id in a binding's name: an id holds no control
/// character ([`check_id`]), so the last one splits the name unambiguously.
const SEPARATOR: char = '\n';

/// The name of the binding of upload `id` of `object`.
pub fn binding(object: &str, id: &str) -> String {
    let mut name = String::with_capacity(object.len() + 1 + id.len());
    name.push_str(object);
    name.push(SEPARATOR);
    name.push_str(id);
    name
}

/// The object a binding's name names.
fn object_of(name: &str) -> &str {
    name.rsplit_once(SEPARATOR).map_or(name, |(object, _)| object)
}

/// Refuses an upload id of `object` that a binding's name could not hold unambiguously: empty,
/// or with a control character.
pub fn check_id(object: &str, id: &str) -> Result<(), FenceError> {
    if id.is_empty() || id.chars().any(char::is_control) {
        let upload = format!("{:?}", id);
        return Err(FenceError::UnknownUpload { object: object.to_owned(), upload });
    }
    Ok(())
}

impl Fence {
    /// Refuses a part, completion or abort of upload `id` of `object` with `token` unless the
    /// upload was created for that object with that token.
    pub fn check_upload(&self, object: &str, id: &str, token: u64) -> Result<(), FenceError> {
        check_id(object, id)?;
        let unknown = || FenceError::UnknownUpload { object: object.to_owned(), upload: id.to_owned() };
        match self.max_seen.level(MarkRef::upload(&binding(object, id))) {
            None => Err(unknown()),
            Some(bound) if bound != token => {
                Err(FenceError::UploadToken { object: object.to_owned(), upload: id.to_owned(), token, bound })
            }
            Some(_) => Ok(()),
        }
    }

    /// Binds upload `id` of `object` to `token`, durably; at `max` bindings, those that can
    /// never complete are dropped first, then the oldest (module docs).
    pub async fn bind_upload(
        &self,
        object: &str,
        id: &str,
        token: u64,
        max: usize,
        scopes: &[Scope],
    ) -> Result<(), BindError> {
        check_id(object, id)?;
        let count = self.max_seen.count(MarkKind::Upload);
        if count >= max {
            let mut dropped = self.dead_uploads(scopes);
            let dead = dropped.len();
            let over = (count + 1).saturating_sub(max);
            if dead < over {
                dropped.extend(self.oldest_uploads(over - dead, &dropped));
            }
            tracing::warn!(
                dead,
                evicted = dropped.len() - dead,
                max,
                "s3.max_uploads multipart uploads were bound: dropped the bindings of those that can never \
                complete, and of the oldest if that left no room (their parts and completions are refused)"
            );
            self.store.commit(self.store.term(), MarkBatch::drop_bindings(dropped)).await?;
        }
        let batch = MarkBatch::advance([Mark::upload(binding(object, id))], token);
        Ok(self.store.commit(self.store.term(), batch).await?)
    }

    /// The `n` bindings with the lowest tokens, leaving out those in `except`.
    fn oldest_uploads(&self, n: usize, except: &[Mark]) -> Vec<Mark> {
        let mut all = Vec::new();
        self.max_seen.for_each(MarkKind::Upload, |name, token, _| all.push((token, name.to_owned())));
        all.sort_unstable();
        let names = all.into_iter().map(|(_, name)| Mark::upload(name));
        names.filter(|mark| !except.contains(mark)).take(n).collect()
    }

    /// Drops the binding of upload `id` of `object`: its upload ended. Need not be durable: a
    /// binding left behind names an upload the server has ended.
    pub async fn drop_upload(&self, object: &str, id: &str) -> Result<(), StoreError> {
        let name = binding(object, id);
        if self.max_seen.level(MarkRef::upload(&name)).is_none() {
            return Ok(());
        }
        self.store.commit(self.store.term(), MarkBatch::drop_bindings([Mark::upload(name)])).await
    }

    /// The bindings whose upload can never complete: its object's fence key (or a floor over
    /// it) is above the binding's token.
    fn dead_uploads(&self, scopes: &[Scope]) -> Vec<Mark> {
        let mut dead = Vec::new();
        self.max_seen.for_each(MarkKind::Upload, |name, token, _| {
            let key = resource_key(object_of(name), scopes);
            let touch = Touch { key: key.to_owned(), coverage: Coverage::Key };
            if self.judge(&touch, token, EqualToken::Accept.into()).is_err() {
                dead.push(Mark::upload(name));
            }
        });
        dead
    }
}

/// Why an upload could not be bound.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BindError {
    /// The fence refused it.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// The store did not make it durable.
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_upload_continues_only_for_its_object_and_token() {
        let (fence, _dir) = super::super::turn::tests::fence();
        fence.bind_upload("/b/k", "id1", 41, 10, &[]).await.unwrap();
        assert!(fence.check_upload("/b/k", "id1", 41).is_ok());
        let decoy = fence.check_upload("/b/decoy", "id1", 41).unwrap_err();
        assert!(matches!(decoy, FenceError::UnknownUpload { .. }), "{decoy}");
        let other = fence.check_upload("/b/k", "id1", 42).unwrap_err();
        assert!(matches!(other, FenceError::UploadToken { bound: 41, token: 42, .. }), "{other}");
        assert!(matches!(fence.check_upload("/b/k", "id\n2", 41), Err(FenceError::UnknownUpload { .. })));
        fence.drop_upload("/b/k", "id1").await.unwrap();
        assert!(matches!(fence.check_upload("/b/k", "id1", 41), Err(FenceError::UnknownUpload { .. })));
    }

    #[tokio::test]
    async fn at_the_bound_dead_bindings_make_room_then_the_oldest() {
        let (fence, _dir) = super::super::turn::tests::fence();
        // The test fence holds /a at 34.
        fence.bind_upload("/a", "old", 30, 2, &[]).await.unwrap();
        fence.bind_upload("/b", "live", 5, 2, &[]).await.unwrap();
        fence.bind_upload("/c", "new", 7, 2, &[]).await.unwrap();
        assert!(matches!(fence.check_upload("/a", "old", 30), Err(FenceError::UnknownUpload { .. })), "dead");
        assert!(fence.check_upload("/b", "live", 5).is_ok(), "a dead binding made room");
        // Every binding may complete: the oldest (lowest token) makes room.
        fence.bind_upload("/d", "more", 9, 2, &[]).await.unwrap();
        assert!(matches!(fence.check_upload("/b", "live", 5), Err(FenceError::UnknownUpload { .. })), "evicted");
        assert!(fence.check_upload("/c", "new", 7).is_ok() && fence.check_upload("/d", "more", 9).is_ok());
        assert_eq!(fence.max_seen.count(MarkKind::Upload), 2);
    }
}
