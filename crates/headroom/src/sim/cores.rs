//! Independent simulations spread over the machine's cores, at one level only: a job already
//! running on a worker (a layout of `fit`'s search) runs its own parts (its ranks) in turn,
//! so the cores are never asked for more threads than they have.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is one of [`on_every_core`]'s workers.
pub(crate) fn on_worker() -> bool {
    ON_WORKER.with(Cell::get)
}

/// Whether [`on_every_core`] would spread jobs over threads here: not on a worker, and more
/// than one core.
pub(crate) fn spreads() -> bool {
    !on_worker() && cores() > 1
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `run` of every job on `available_parallelism()` scoped threads, each taking the next job
/// from an atomic counter; the results in the jobs' order. Jobs start by `cost`, the most
/// costly first, so that the cores run out of work together: the last jobs taken are the
/// shortest. Called from a worker, or with one job or one core, the jobs run here in turn.
pub(crate) fn on_every_core<J: Sync, R: Send>(
    jobs: &[J],
    cost: impl Fn(&J) -> u64,
    run: impl Fn(&J) -> R + Sync,
) -> Vec<R> {
    let threads = cores();
    if !spreads() || jobs.len() < 2 {
        return jobs.iter().map(run).collect();
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&j| std::cmp::Reverse(cost(&jobs[j])));
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(jobs.len()))
            .map(|_| {
                scope.spawn(|| {
                    ON_WORKER.with(|w| w.set(true));
                    let mut done = Vec::new();
                    while let Some(&j) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        done.push((j, run(&jobs[j])));
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a simulation thread panicked"))
            .collect()
    });
    done.sort_unstable_by_key(|(j, _)| *j);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Results come back in the jobs' order, and a worker's own jobs run on it.
    #[test]
    fn results_keep_the_jobs_order_and_workers_do_not_nest() {
        let jobs: Vec<u64> = (0..50).collect();
        let out = on_every_core(
            &jobs,
            |&j| j % 7,
            |&j| {
                let nested = on_every_core(&[1u64, 2], |_| 0, |_| on_worker());
                (j * 2, nested)
            },
        );
        let threads = cores();
        for (j, (doubled, nested)) in out.into_iter().enumerate() {
            assert_eq!(doubled, j as u64 * 2);
            // On a worker the nested jobs run on it (the flag is set); alone, no worker exists.
            assert_eq!(nested, vec![threads > 1; 2]);
        }
        assert!(!on_worker());
    }
}
