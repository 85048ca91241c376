//! Answers from the writer thread to the requests waiting for them: one wake-up of their
//! runtime per batch, not one per request.
//!
//! Waking a task of a current-thread runtime from another thread makes tokio unpark the
//! runtime's driver for that task: a write to its eventfd, and often a wake-up of its thread,
//! per request. So the writer hands a batch's answers to a relay task on the runtime that
//! opened the store, with one wake-up, and the relay answers each request from there, where a
//! wake-up is a push onto the runtime's own queue. Without that runtime (the store was opened
//! outside one, or the runtime shut down), the writer answers each request itself. The relay
//! task ends when the writer's side is dropped (the store closed), so a closed store leaves
//! nothing behind on the runtime.

use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, oneshot};

use super::StoreError;

/// Where an advance's outcome goes.
pub(super) type Done = oneshot::Sender<Result<(), StoreError>>;

/// An answer and the request it is for.
pub(super) type Answer = (Done, Result<(), StoreError>);

/// The writer's side of the relay.
#[derive(Debug)]
pub(super) struct Relay {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Answers for the relay task to send, and whether that task still runs: both behind one
    /// lock, so that no answer is left behind by a task that stops.
    waiting: Mutex<Waiting>,
    notify: Notify,
}

#[derive(Debug, Default)]
struct Waiting {
    answers: Vec<Answer>,
    alive: bool,
    /// The writer's side is gone: no more answers will come.
    closed: bool,
}

impl Relay {
    /// Starts the relay task on the current runtime, if there is one.
    pub(super) fn start() -> Relay {
        let shared = Arc::new(Shared::default());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            shared.waiting.lock().unwrap_or_else(|e| e.into_inner()).alive = true;
            drop(runtime.spawn(relay(Stopping(Arc::clone(&shared)))));
        }
        Relay { shared }
    }

    /// Sends `answers` on, emptying it.
    pub(super) fn deliver(&self, answers: &mut Vec<Answer>) {
        if answers.is_empty() {
            return;
        }
        let mut waiting = self.shared.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if !waiting.alive {
            drop(waiting);
            send(answers.drain(..));
            return;
        }
        let was_empty = waiting.answers.is_empty();
        waiting.answers.append(answers);
        drop(waiting);
        if was_empty {
            self.shared.notify.notify_one();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.waiting.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        // A permit if the task is not waiting yet: it cannot miss this.
        self.shared.notify.notify_one();
    }
}

fn send(answers: impl Iterator<Item = Answer>) {
    for (done, outcome) in answers {
        let _ = done.send(outcome);
    }
}

/// The relay task: answers each batch handed to it.
async fn relay(stopping: Stopping) {
    let shared = &stopping.0;
    let mut batch = Vec::new();
    loop {
        shared.notify.notified().await;
        let closed = {
            let mut waiting = shared.waiting.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::swap(&mut batch, &mut waiting.answers);
            waiting.closed
        };
        send(batch.drain(..));
        if closed {
            return; // `stopping` answers anything handed over since
        }
    }
}

/// Dropped with the relay task (its runtime shut down): answers what was handed to it, and
/// tells the writer to answer by itself from now on.
struct Stopping(Arc<Shared>);

impl Drop for Stopping {
    fn drop(&mut self) {
        let mut waiting = self.0.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.alive = false;
        send(waiting.answers.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_relay_task_answers_and_ends_when_the_writer_side_is_dropped() {
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let relay = Relay::start();
        assert_eq!(metrics.num_alive_tasks(), before + 1);
        let (done, answer) = oneshot::channel();
        relay.deliver(&mut vec![(done, Ok(()))]);
        assert!(answer.await.unwrap().is_ok());
        drop(relay);
        for _ in 0..1000 {
            if metrics.num_alive_tasks() == before {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the relay task outlived its writer");
    }
}
