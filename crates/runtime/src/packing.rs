//! Many inputs, few device passes: inputs are packed back to back (no padding) into passes
//! under a budget of token rows and media rows, prepared on the host while the device runs the
//! previous pass, and a pass that runs out of device memory is split and retried.

use tessera_core::{Error, Result};

use crate::pipeline::pipelined;

/// What an input takes in a pass, and a pass's budget: token rows and media rows (image
/// patches).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    pub rows: usize,
    pub media: usize,
}

impl Cost {
    fn plus(self, o: Cost) -> Cost {
        Cost {
            rows: self.rows + o.rows,
            media: self.media + o.media,
        }
    }
    fn within(self, budget: Cost) -> bool {
        self.rows <= budget.rows && self.media <= budget.media
    }
}

/// Run every prepared item through `run`, in order, packed into passes within `budget` (an
/// item larger than the budget gets a pass of its own). `prepared` yields chunks of items, made
/// on another thread while passes run. `done` receives each pass's items with their outputs.
///
/// A pass that fails with [`Error::OutOfMemory`] is split in two and each half retried, down to
/// a single item, whose failure is reported with its size.
pub fn run_packed<P: Send, O>(
    prepared: impl ExactSizeIterator<Item = Result<Vec<P>>> + Send,
    budget: Cost,
    cost: impl Fn(&P) -> Cost,
    mut run: impl FnMut(&[P]) -> Result<Vec<O>>,
    mut done: impl FnMut(&[P], Vec<O>) -> Result<()>,
) -> Result<()> {
    let mut batch: Vec<P> = Vec::new();
    let mut used = Cost::default();
    let mut flush = |batch: &mut Vec<P>| -> Result<()> {
        if !batch.is_empty() {
            run_split(batch, &cost, &mut run, &mut done)?;
            batch.clear();
        }
        Ok(())
    };
    pipelined(prepared, |chunk| {
        for p in chunk {
            let c = cost(&p);
            if !batch.is_empty() && !used.plus(c).within(budget) {
                flush(&mut batch)?;
                used = Cost::default();
            }
            used = used.plus(c);
            batch.push(p);
        }
        Ok(())
    })?;
    flush(&mut batch)
}

/// One pass over `batch`, halved and retried while it runs out of device memory.
fn run_split<P, O>(
    batch: &[P],
    cost: &impl Fn(&P) -> Cost,
    run: &mut impl FnMut(&[P]) -> Result<Vec<O>>,
    done: &mut impl FnMut(&[P], Vec<O>) -> Result<()>,
) -> Result<()> {
    match run(batch) {
        Ok(out) if out.len() == batch.len() => done(batch, out),
        Ok(out) => Err(Error::backend(
            "pass",
            format!("{} outputs for {} inputs", out.len(), batch.len()),
        )),
        Err(Error::OutOfMemory(_)) if batch.len() > 1 => {
            let (a, b) = batch.split_at(batch.len() / 2);
            run_split(a, cost, run, done)?;
            run_split(b, cost, run, done)
        }
        Err(Error::OutOfMemory(m)) => {
            let c = cost(&batch[0]);
            let media = if c.media > 0 {
                format!(" and {} image patches", c.media)
            } else {
                String::new()
            };
            Err(Error::OutOfMemory(format!(
                "{m} (one input of {} tokens{media} does not fit by itself; shorten it, e.g. with --max-tokens)",
                c.rows
            )))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items are their token counts; a pass over more than `room` tokens runs out of memory.
    fn run_with_room(
        items: &[usize],
        chunk: usize,
        budget: usize,
        room: usize,
    ) -> Result<(Vec<Vec<usize>>, Vec<usize>)> {
        let mut passes = Vec::new();
        let mut outs = Vec::new();
        let chunks = items.chunks(chunk).map(|c| Ok(c.to_vec()));
        run_packed(
            chunks,
            Cost {
                rows: budget,
                media: usize::MAX,
            },
            |&n| Cost { rows: n, media: 0 },
            |batch: &[usize]| {
                if batch.iter().sum::<usize>() > room {
                    return Err(Error::OutOfMemory("test".into()));
                }
                passes.push(batch.to_vec());
                Ok(batch.iter().map(|n| n * 10).collect())
            },
            |batch, out: Vec<usize>| {
                assert_eq!(batch.len(), out.len());
                outs.extend(out);
                Ok(())
            },
        )?;
        Ok((passes, outs))
    }

    #[test]
    fn packs_in_order_within_the_budget_across_chunks() {
        let items = [3, 4, 2, 9, 1, 1, 12, 5];
        let (passes, outs) = run_with_room(&items, 3, 10, usize::MAX).unwrap();
        assert_eq!(
            passes,
            [vec![3, 4, 2], vec![9, 1], vec![1], vec![12], vec![5]]
        );
        assert_eq!(outs, items.map(|n| n * 10));
    }

    #[test]
    fn a_pass_out_of_memory_is_split_until_it_fits() {
        let items = [3, 4, 2, 1];
        let (passes, outs) = run_with_room(&items, 4, 100, 5).unwrap();
        assert_eq!(passes, [vec![3], vec![4], vec![2, 1]]);
        assert_eq!(outs, items.map(|n| n * 10));
        let e = run_with_room(&[2, 9], 2, 100, 5).unwrap_err().to_string();
        assert!(e.contains("one input of 9 tokens does not fit"), "{e}");
    }
}
