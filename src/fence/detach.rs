//! A future that runs to its end even if whoever awaits it goes away.
//!
//! A fenced write that has begun must finish (its outcome recorded, its turn handed on) whether
//! or not its client is still there to hear the answer; hyper drops a request's future when
//! its client hangs up. A task per write would guarantee that, at the cost of a spawn and a
//! hand-off between tasks for every write. [`Detached`] polls the write in place, inside the
//! caller's future, and hands it to a task of its own only if the caller drops it unfinished:
//! the rare case pays for the spawn. A panic while it is polled is caught and returned as an
//! error, with the write's future dropped (so its turn ends as a task's would).

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// The write, boxed so that it can move to a task when its caller leaves.
type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Runs `future` to its end: here while awaited, on a task of its own once dropped unfinished.
pub(super) struct Detached<T: Send + 'static> {
    future: Option<Boxed<T>>,
    /// The runtime it was made on: where it finishes if dropped, whichever thread drops it.
    runtime: Option<tokio::runtime::Handle>,
}

impl<T: Send + 'static> Detached<T> {
    pub(super) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Detached { future: Some(Box::pin(future)), runtime: tokio::runtime::Handle::try_current().ok() }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    /// The future's output, or what its panic said.
    type Output = Result<T, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Ready(Err("the write was polled after it ended".into()));
        };
        let polled = catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.future = None;
                Poll::Ready(Ok(output))
            }
            Err(panic) => {
                // Dropped now, as a task that panicked is: the turn's own Drop settles it.
                self.future = None;
                Poll::Ready(Err(panic_message(panic.as_ref())))
            }
        }
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            match self.runtime.take().or_else(|| tokio::runtime::Handle::try_current().ok()) {
                // A runtime that is shutting down drops it at once, as it cancels its tasks:
                // the turn settles as unknown (quarantined, and still in flight in the log).
                Some(runtime) => drop(runtime.spawn(future)),
                // Made and dropped outside any runtime: nothing can finish it, and dropping
                // it settles the turn the same way.
                None => drop(future),
            }
        }
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    format!("panicked: {message}")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_future_dropped_unfinished_runs_to_its_end_on_a_task() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let finished = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&finished);
        let mut detached = Box::pin(Detached::new(async move {
            let _ = wait.await;
            seen.store(true, Ordering::SeqCst);
        }));
        // Polled once (it waits), then dropped, as hyper drops a request whose client left.
        assert!(futures_poll_once(detached.as_mut()).is_pending());
        drop(detached);
        go.send(()).unwrap();
        for _ in 0..1000 {
            if finished.load(Ordering::SeqCst) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the dropped write never finished");
    }

    #[tokio::test]
    async fn a_panic_is_an_error_and_drops_the_future() {
        struct Settles(Arc<AtomicBool>);
        impl Drop for Settles {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let settled = Arc::new(AtomicBool::new(false));
        let guard = Settles(Arc::clone(&settled));
        let failed = Detached::new(async move {
            let _guard = guard;
            panic!("a bug while forwarding");
        })
        .await;
        assert_eq!(failed, Err("panicked: a bug while forwarding".to_owned()));
        assert!(settled.load(Ordering::SeqCst), "what the future held was dropped");
    }

    fn futures_poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        future.poll(&mut Context::from_waker(waker))
    }
}
