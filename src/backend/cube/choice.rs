//! Which fusers a stream gets: [`FUSERS_ENV`], the fuser kinds and their tie-break order, and
//! the public constructors [`cube_fuser`] and [`cube_fuser_with`].

use super::*;

/// The fuser of a `StreamFusion<CubeBackend<R, F, I, BT>>` stream.
pub type CubeStreamFuser<R, F, I, BT> = Box<dyn Fuser<BackendRuntime<CubeBackend<R, F, I, BT>>>>;

/// The environment variable that picks the fusers of `StreamFusion<CubeBackend>` streams (read
/// when a stream is created): a comma-separated list of `elementwise`, `matmul`, `reduce` and
/// `reduce_broadcasted`, or `all`, or `none` (no kernel fusion at all). Unset, it is
/// `elementwise,matmul`. An unknown name is reported (a `tracing` warning) and the default is
/// used.
///
/// The reduce fusers are opt-in: on the benchmark's softmax and layer norm they do not win
/// measurably on the H200 (see docs/BENCHMARKS.md, "Reduce fusion (opt-in)"). The runs
/// burn-cubecl-fusion 0.21 launches them wrongly on are never theirs (`policy::first_block`).
/// A softmax is one kernel of this crate's on these streams, so the reduce fusers see one only
/// where that kernel is unregistered ([`register_softmax`](crate::backend::register_softmax)).
pub const FUSERS_ENV: &str = "FUSION_STREAMS_CUBE_FUSERS";

/// The environment variable that sets how many times a run cut by its own thread's drain (a
/// read, a sync) before its fusers closed it must have been met, in this process on any stream,
/// for it to be fused (read when a stream is created). Unset, it is 2: a cut run met for the
/// first time runs operation by operation, and from its second time on as one kernel. `1` fuses
/// every such run, as a run closed by its fusers always is; `0` fuses none whose kernel the
/// stream has not built already. A program that reads at the same point every iteration cuts
/// the same run each time, and pays one unfused iteration.
///
/// Why: a fused kernel is compiled once per distinct run, which costs milliseconds. Runs cut by
/// another thread's drain follow [`FOREIGN_CUT_SIGHTINGS_ENV`]. An unknown value is reported (a
/// `tracing` warning) and the default is used.
pub const CUT_SIGHTINGS_ENV: &str = "FUSION_STREAMS_CUBE_CUT_SIGHTINGS";

/// [`CUT_SIGHTINGS_ENV`]'s default.
pub(super) const DEFAULT_CUT_SIGHTINGS: u32 = 2;

/// [`CUT_SIGHTINGS_ENV`] for runs cut by another thread's drain: a share of one of the stream's
/// tensors, a read of one from another thread, or by the engine's service thread: a thread's
/// exit, a deferred free's deadline ([`crate::runtime::Cut::Foreign`]). Unset, it is
/// 0: such a run executes operation by operation unless the stream has built its kernel
/// already (it closed the same run before).
///
/// Why: where another thread's drain cuts the open run depends on that thread's timing. A
/// producer thread whose results a consumer shares one by one is cut at a new point nearly
/// every time: fusing every cut compiled about ten kernels per 200 results that never ran
/// again, 0.015 of plain `CubeBackend` on the H200
/// (`docs/logs/2026-12-03-pipeline-compilations.log`), and counting sightings still compiles
/// every cut point that comes up twice.
pub const FOREIGN_CUT_SIGHTINGS_ENV: &str = "FUSION_STREAMS_CUBE_FOREIGN_CUT_SIGHTINGS";

/// [`FOREIGN_CUT_SIGHTINGS_ENV`]'s default.
pub(super) const DEFAULT_FOREIGN_CUT_SIGHTINGS: u32 = 0;

/// The environment variable that sets the fewest operations (drops not counted) a run must have
/// for the elementwise fuser's kernel to replace it (read when a stream is created). Unset, it
/// is 3: a run of two elementwise operations executes operation by operation. `2` fuses every
/// run the engine can (the engine never fuses a single operation). Runs the matmul or reduce
/// fusers cover are not affected. An unknown value is reported (a `tracing` warning) and the
/// default is used.
///
/// Why: burn-cubecl-fusion's elementwise launch does more host work than two plain launches
/// save: it binds every input and output and plans vector widths on each call. On the H200 the
/// two-operation runs of the benchmark's softmax (the subtraction and `exp`) and attention step
/// (scale and mask, subtraction and `exp`) ran 4–22% slower fused than operation by operation,
/// at 64 rows as at 512 positions, while runs of three and more (the layer norm, the chains)
/// win (docs/BENCHMARKS.md, "Two-operation runs").
pub const MIN_ELEMENTWISE_OPS_ENV: &str = "FUSION_STREAMS_CUBE_MIN_ELEMENTWISE_OPS";

/// [`MIN_ELEMENTWISE_OPS_ENV`]'s default.
pub(super) const DEFAULT_MIN_ELEMENTWISE_OPS: u32 = 3;

/// The number of sightings environment variable `name` asks for, `default` when unset.
pub(super) fn sightings_from_env(name: &str, default: u32) -> u32 {
    match std::env::var(name) {
        Ok(value) => value.trim().parse::<u32>().unwrap_or_else(|_| {
            tracing::warn!(
                target: "fusion_streams",
                "{name}={value:?} is not a whole number; using {default}"
            );
            default
        }),
        Err(_) => default,
    }
}

/// The fusers, in the order that breaks a tie between two that cover the same run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum FuserKind {
    Elementwise,
    Matmul,
    Reduce,
    ReduceBroadcasted,
}

impl FuserKind {
    pub(super) const ALL: [FuserKind; 4] = [
        FuserKind::Elementwise,
        FuserKind::Matmul,
        FuserKind::Reduce,
        FuserKind::ReduceBroadcasted,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            FuserKind::Elementwise => "elementwise",
            FuserKind::Matmul => "matmul",
            FuserKind::Reduce => "reduce",
            FuserKind::ReduceBroadcasted => "reduce_broadcasted",
        }
    }

    pub(super) fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of [`FuserKind`]s, one bit each.
pub(super) type Kinds = u8;

pub(super) const DEFAULT_KINDS: Kinds = 0b0011;

/// The fusers `spec` names (see [`FUSERS_ENV`]).
pub(super) fn parse_kinds(spec: &str) -> std::result::Result<Kinds, String> {
    let mut kinds = 0;
    for name in spec
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
    {
        kinds |= match name {
            "all" => FuserKind::ALL.iter().map(|kind| kind.bit()).sum(),
            "none" => 0,
            name => match FuserKind::ALL.iter().find(|kind| kind.name() == name) {
                Some(kind) => kind.bit(),
                None => {
                    return Err(format!(
                        "unknown fuser `{name}` in {FUSERS_ENV}={spec:?} (known: elementwise, \
                         matmul, reduce, reduce_broadcasted, all, none)"
                    ));
                }
            },
        };
    }
    Ok(kinds)
}

/// The fusers [`FUSERS_ENV`] asks for.
pub(super) fn kinds_from_env() -> Kinds {
    match std::env::var(FUSERS_ENV) {
        Ok(spec) => parse_kinds(&spec).unwrap_or_else(|error| {
            tracing::warn!(target: "fusion_streams", "{error}; using elementwise,matmul");
            DEFAULT_KINDS
        }),
        Err(_) => DEFAULT_KINDS,
    }
}

/// The fuser of `StreamFusion<CubeBackend<R, F, I, BT>>` streams, with the fusers
/// [`FUSERS_ENV`] asks for: registered for the CUDA backends by default; pass it to
/// [`register_fuser`](crate::backend::register_fuser) for a `CubeBackend` over another cubecl runtime.
pub fn cube_fuser<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    device: &R::Device,
) -> CubeStreamFuser<R, F, I, BT> {
    Box::new(CubeFuser::<R, CubeBackend<R, F, I, BT>>::new(fusers(
        device,
        kinds_from_env(),
    )))
}

/// The fuser of `StreamFusion<CubeBackend<R, F, I, BT>>` streams with the fusers `names` lists
/// (the syntax of [`FUSERS_ENV`]), whatever the environment says; for
/// [`register_fuser`](crate::backend::register_fuser). An unknown name is an [`Error::InvalidConfig`].
///
/// ```no_run
/// use burn_cubecl::CubeBackend;
/// use cubecl::cuda::CudaRuntime;
/// use fusion_streams::backend::{cube_fuser_with, register_fuser};
///
/// type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
/// // Every fuser, reductions included, for the engines opened from here on.
/// register_fuser::<Cuda>(|device| cube_fuser_with(device, "all").expect("known names"));
/// ```
pub fn cube_fuser_with<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    device: &R::Device,
    names: &str,
) -> Result<CubeStreamFuser<R, F, I, BT>> {
    let kinds = parse_kinds(names).map_err(Error::InvalidConfig)?;
    Ok(Box::new(CubeFuser::<R, CubeBackend<R, F, I, BT>>::new(
        fusers(device, kinds),
    )))
}

/// burn-cubecl-fusion's fusers of `kinds`, as built, in [`FuserKind`] order.
pub(super) fn fusers<R: CubeRuntime>(device: &R::Device, kinds: Kinds) -> [Option<DynFuser<R>>; 4] {
    FuserKind::ALL.map(|kind| {
        (kinds & kind.bit() != 0).then(|| -> DynFuser<R> {
            match kind {
                FuserKind::Elementwise => Box::new(ElementWiseFuser::new(device.clone())),
                FuserKind::Matmul => Box::new(MatmulFuser::new(device.clone())),
                FuserKind::Reduce => {
                    Box::new(ReduceFuser::new(device.clone(), ReduceSettings::Always))
                }
                FuserKind::ReduceBroadcasted => {
                    Box::new(ReduceBroadcastedFuser::new(device.clone()))
                }
            }
        })
    })
}
