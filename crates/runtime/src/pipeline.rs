//! Overlapping host work with device work.

use tessera_core::{Error, Result};

/// Hands the items of `produce`, made on a scoped thread, to `consume` on this one: producing
/// runs up to two items ahead, so host work (preparing inputs) overlaps the consumer's device
/// passes. Stops at the first error, in item order; a panic while producing becomes an error.
pub fn pipelined<T: Send>(
    mut produce: impl ExactSizeIterator<Item = Result<T>> + Send,
    mut consume: impl FnMut(T) -> Result<()>,
) -> Result<()> {
    if produce.len() <= 1 {
        // Nothing to overlap.
        return produce.try_for_each(|item| consume(item?));
    }
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let producer = s.spawn(move || {
            for item in produce {
                let failed = item.is_err();
                // Sending fails once the consumer has stopped.
                if tx.send(item).is_err() || failed {
                    break;
                }
            }
        });
        let consumed = rx.iter().try_for_each(|item| consume(item?));
        // Wakes a producer blocked on the full channel.
        drop(rx);
        let produced = producer.join().map_err(|p| {
            Error::backend("preparing inputs", format!("panicked: {}", panic_text(&*p)))
        });
        consumed.and(produced)
    })
}

/// The message a panic was raised with (`panic!("…")` gives a `&str` or a `String`).
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn pipelined_keeps_order_and_returns_the_first_error() {
        let mut got = Vec::new();
        pipelined((0..10).map(Ok), |i| {
            got.push(i);
            Ok(())
        })
        .unwrap();
        assert_eq!(got, (0..10).collect::<Vec<_>>());

        // A producer error comes after the items before it.
        got.clear();
        let items = (0..10).map(|i| match i {
            5 => Err(Error::input("bad 5")),
            i => Ok(i),
        });
        let e = pipelined(items, |i| {
            got.push(i);
            Ok(())
        });
        assert_eq!(e.unwrap_err().to_string(), "bad 5");
        assert_eq!(got, [0, 1, 2, 3, 4]);

        // A consumer error stops the producer within the channel's reach.
        let made = AtomicUsize::new(0);
        let items = (0..1000).map(|i| {
            made.fetch_add(1, Ordering::Relaxed);
            Ok(i)
        });
        let e = pipelined(items, |i| match i {
            3 => Err(Error::input("consumer 3")),
            _ => Ok(()),
        });
        assert_eq!(e.unwrap_err().to_string(), "consumer 3");
        assert!(made.load(Ordering::Relaxed) <= 6, "{made:?} made");

        // A panic while producing becomes an error.
        let items = (0..4).map(|i| match i {
            2 => panic!("boom"),
            i => Ok(i),
        });
        let e = pipelined(items, |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("boom"), "{e}");
    }
}
