//! A pipeline's components (text encoders, VAEs): one generic [`Component`] over one runner.
//! A component kind ([`ComponentKind`]) says how its graph is built for a shape (a token count,
//! a latent size) and what its config is; opening, planning, the pass limit, handing the backend
//! to the next phase and running one pass with a finite-checked output are written once, here.

use crate::backend::Backend;
use crate::error::Result;
use crate::exec::{ExecOptions, ExecStats, Executor};
use crate::graph::{Graph, HostTensor};
use crate::io::model::ModelIndex;

use super::Drive;

/// A kind of component: how its graph is built.
pub trait ComponentKind {
    /// What the graph is built for (a token count, a latent's height and width).
    type Shape: Copy + std::fmt::Debug;
    /// Its typed configuration.
    type Config;
    /// Its name, for messages.
    const NAME: &'static str;
    /// The graph for `shape`, and the configuration it read.
    fn build(model: &ModelIndex, shape: Self::Shape) -> Result<(Graph, Self::Config)>;
}

/// A component ready to run on a backend: its graph planned and allocated, its resident weights
/// loaded.
pub struct Component<K: ComponentKind, B: Backend> {
    pub(crate) run: Runner<B>,
    pub(crate) config: K::Config,
    pub(crate) shape: K::Shape,
}

impl<K: ComponentKind, B: Backend> std::fmt::Debug for Component<K, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(K::NAME).field("shape", &self.shape).finish()
    }
}

impl<K: ComponentKind, B: Backend> Component<K, B> {
    /// Builds the graph for `shape`, plans memory and loads the resident weights.
    #[cfg(feature = "native")]
    pub fn new(model: &ModelIndex, backend: B, shape: K::Shape, opts: ExecOptions) -> Result<Self> {
        crate::io::folder::block_on(Self::open(model, backend, shape, opts, &Drive::Blocking))
    }

    /// [`Component::new`], reading as `drive` says.
    pub async fn open(
        model: &ModelIndex,
        backend: B,
        shape: K::Shape,
        opts: ExecOptions,
        drive: &Drive<'_>,
    ) -> Result<Self> {
        let (graph, config) = K::build(model, shape)?;
        Ok(Component {
            run: Runner::open(graph, model, backend, opts, drive).await?,
            config,
            shape,
        })
    }

    /// The executor (its plan, its backend).
    pub fn executor(&self) -> &Executor<B> {
        &self.run.ex
    }

    /// Limits the weight stream to `passes` more runs, so that nothing is read ahead into a run
    /// that will not come (the bytes read then equal the plan's).
    pub fn limit_passes(&mut self, passes: u64) {
        self.run.ex.limit_stream_passes(passes);
    }

    /// The configuration.
    pub fn config(&self) -> &K::Config {
        &self.config
    }

    /// What the graph was built for.
    pub fn shape(&self) -> K::Shape {
        self.shape
    }

    /// The backend back, its device memory released (for the next phase).
    pub fn into_backend(self) -> B {
        self.run.into_backend()
    }

    /// One pass with `inputs`: the output, checked finite (`what` names it in the error).
    pub(crate) async fn pass(
        &mut self,
        inputs: &[HostTensor],
        what: &str,
    ) -> Result<(Vec<f32>, ExecStats)> {
        self.run.run(inputs, what).await
    }
}

/// Plans, allocates and loads the resident weights of `graph` on `backend`, reading as `drive`
/// says (the browser awaits the resident groups' reads).
pub(crate) async fn open_executor<B: Backend>(
    graph: Graph,
    model: &ModelIndex,
    backend: B,
    opts: ExecOptions,
    drive: &Drive<'_>,
) -> Result<Executor<B>> {
    match drive {
        Drive::Blocking => Executor::new(graph, model, backend, opts),
        Drive::EventLoop(maker) => {
            let mut make = maker(model);
            Executor::with_source_async(graph, model, backend, opts, &mut make).await
        }
    }
}

/// A model's graph bound to a backend, each program with one output: the runner the encoders
/// and the VAEs share.
pub(crate) struct Runner<B: Backend> {
    pub(crate) ex: Executor<B>,
    event_loop: bool,
}

impl<B: Backend> Runner<B> {
    /// Plans, allocates and loads the resident weights of `graph`, as `drive` says.
    pub(crate) async fn open(
        graph: Graph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        drive: &Drive<'_>,
    ) -> Result<Self> {
        Ok(Runner {
            ex: open_executor(graph, model, backend, opts, drive).await?,
            event_loop: matches!(drive, Drive::EventLoop(_)),
        })
    }

    /// One step with `inputs`: the output, checked finite (`what` names it in the error).
    pub(crate) async fn run(
        &mut self,
        inputs: &[HostTensor],
        what: &str,
    ) -> Result<(Vec<f32>, ExecStats)> {
        self.run_program(0, inputs, what).await
    }

    /// [`Runner::run`] of program `p`.
    pub(crate) async fn run_program(
        &mut self,
        p: usize,
        inputs: &[HostTensor],
        what: &str,
    ) -> Result<(Vec<f32>, ExecStats)> {
        let (out, stats) = if self.event_loop {
            self.ex.step_program_async(p, inputs).await?
        } else {
            self.ex.step_program(p, inputs)?
        };
        let v = out
            .into_iter()
            .next()
            .ok_or_else(|| crate::Error::Invalid(format!("{what}: the graph has no output")))?
            .into_f32();
        crate::error::check_finite(&v, || what.to_string())?;
        Ok((v, stats))
    }

    /// The backend back, its device memory released (for the next phase).
    pub(crate) fn into_backend(self) -> B {
        self.ex.into_parts().0
    }
}
