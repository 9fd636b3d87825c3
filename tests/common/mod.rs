//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

use burn_backend::{DType, Shape, TensorData};
use burn_ir::{CustomOpIr, HandleContainer};
use fusion_streams::host::{HostDevice, HostHandle, HostRuntime, HostStats};

use fusion_streams::runtime::StreamRuntime;
use fusion_streams::transfer::PinnedHostBuffer;
use fusion_streams::{CustomExecutor, EngineConfig, FusionClient, FusionTensor};

pub type Client = FusionClient<HostRuntime>;
pub type Tensor = FusionTensor<HostRuntime>;
/// The handles a host custom op's executor runs against.
pub type Handles = HandleContainer<HostHandle>;

/// A custom f32 op `name` that reads `input` and has one output of `shape`, run by `executor`.
pub fn custom_op<R: StreamRuntime>(
    client: &FusionClient<R>,
    name: &'static str,
    input: &FusionTensor<R>,
    shape: impl Into<Shape>,
    executor: impl CustomExecutor<R>,
) -> FusionTensor<R> {
    client
        .op(name)
        .read(input)
        .output(shape, DType::F32)
        .execute(executor)
        .expect("admitted")
        .remove(0)
}

/// An op `name` over `input` that fails with `message` when it runs: its output carries
/// `Error::operation(name, message)`.
pub fn failing_op<R: StreamRuntime>(
    client: &FusionClient<R>,
    name: &'static str,
    input: &FusionTensor<R>,
    message: &'static str,
) -> FusionTensor<R> {
    let shape = input.shape().clone();
    custom_op(client, name, input, shape, move |_: &_, _: &mut _| {
        Err(fusion_streams::Error::operation(name, message))
    })
}

/// `error` is `root`, propagated: the operation `skipped` (the first one skipped because its
/// input carried it) reports it.
pub fn assert_propagated(
    error: &fusion_streams::Error,
    root: &fusion_streams::Error,
    skipped: &str,
) {
    assert_eq!(error.root(), root, "the root, typed: {error:?}");
    assert!(
        matches!(error, fusion_streams::Error::Propagated { skipped: s, .. } if &**s == skipped),
        "{error:?}: propagated from `{skipped}`, the first skipped operation"
    );
}

/// The body of an identity custom op: its one input's handle becomes its one output.
pub fn pass_through(op: &CustomOpIr, handles: &mut Handles) -> fusion_streams::Result<()> {
    let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
    handles.register_handle(op.outputs[0].id, input);
    Ok(())
}

/// Settings under which nothing executes unless a test asks for it: a queue bound no test
/// reaches, deferred frees that wait for their reader however long the test takes, and no sweep
/// of idle streams while a test thread is descheduled (the service thread's deadline and sweep
/// are tested on their own).
pub fn lazy_config() -> EngineConfig {
    let hour = std::time::Duration::from_secs(3600);
    EngineConfig::default()
        .with_max_queue_len(1024)
        .with_max_deferred_free_delay(hour)
        .with_max_idle_delay(hour)
}

/// A fresh engine on a host device, with [`lazy_config`].
pub fn client() -> Client {
    FusionClient::with_config(HostDevice::default(), lazy_config()).expect("host device")
}

/// A 1-d f32 tensor on any runtime.
pub fn f32s<R: StreamRuntime>(client: &FusionClient<R>, values: &[f32]) -> FusionTensor<R> {
    client
        .from_data(TensorData::new(values.to_vec(), [values.len()]))
        .expect("upload")
}

/// A tensor's values, read to the host.
pub fn values<R: StreamRuntime>(tensor: &FusionTensor<R>) -> Vec<f32> {
    tensor.to_vec::<f32>().expect("read")
}

/// A pinned buffer's bytes as f32s.
pub fn buffer_f32s(buffer: &PinnedHostBuffer) -> Vec<f32> {
    let n = buffer.len() / 4;
    buffer
        .to_data([n], burn_backend::DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

pub fn host(client: &Client) -> HostStats {
    client.context().stats()
}

/// Wait for every dispatched kernel, so buffer counters are final.
pub fn settle(client: &Client) {
    client.sync().expect("sync");
}

/// Run every stream's pending work and settle, then check that the engine holds nothing and
/// the device no buffer.
pub fn assert_nothing_held(client: &Client) {
    client.streams().drain_all();
    settle(client);
    let stats = client.stats();
    assert!(stats.is_quiescent(), "{stats:?}");
    assert_eq!(host(client).live_buffers(), 0, "live buffers");
}

/// Run `test` on a fresh [`client`]; once it has returned (its tensors dropped), check that the
/// engine holds nothing: [`assert_nothing_held`].
pub fn leak_checked(test: impl FnOnce(Client)) {
    let c = client();
    test(c.clone());
    assert_nothing_held(&c);
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread that stays alive between steps, so its stream (and the views it holds) persist.
pub struct Peer {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    pub fn spawn() -> Self {
        let (jobs, queue) = channel::<Job>();
        let thread = std::thread::spawn(move || {
            for job in queue {
                job();
            }
        });
        Self {
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// Run `f` on this thread and return its result.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.start(f).recv().expect("peer thread panicked")
    }

    /// Start `f` on this thread; its result arrives on the returned channel.
    pub fn start<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::sync::mpsc::Receiver<T> {
        let (tx, rx) = channel();
        self.jobs
            .as_ref()
            .unwrap()
            .send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .unwrap();
        rx
    }

    /// The peer's stream id.
    pub fn stream(&self) -> burn_backend::StreamId {
        self.run(burn_backend::StreamId::current)
    }

    /// End the thread (its exit drain runs) and wait for it.
    pub fn join(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            thread.join().expect("peer thread panicked");
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
