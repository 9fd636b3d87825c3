//! `fusion_streams::profile`: what it counts, for which threads, and that it resets and stops.
//! One test in its own process, since the switch and the tallies are process-wide.

use burn_backend::TensorData;
use fusion_streams::FusionClient;
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::profile::{self, Section};

#[test]
fn sections_are_timed_per_thread_reset_by_take_and_stop_when_switched_off() {
    let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    let x = client
        .from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]))
        .unwrap();
    profile::take();

    profile::enable(true);
    profile::mark_current_thread();
    let pending = x.scale(2.0).unwrap(); // recorded on this (marked) thread
    let read = std::thread::scope(|s| {
        // An unmarked thread shares the pending tensor (draining this stream) and reads.
        s.spawn(|| pending.add(&pending).unwrap().to_vec::<f32>().unwrap())
            .join()
            .unwrap()
    });
    assert_eq!(read, vec![4.0, 8.0, 12.0]);
    let spent = profile::take();

    let share = spent.section(Section::Share);
    assert!(share.all.count >= 1, "{spent}");
    assert_eq!(
        share.marked.count, 0,
        "the share ran on the unmarked thread: {spent}"
    );
    assert!(share.all.time > std::time::Duration::ZERO, "{spent}");
    let record = spent.section(Section::Record);
    assert!(
        record.marked.count >= 1,
        "this thread recorded the scale: {spent}"
    );
    assert!(
        record.all.count >= 2,
        "and the other thread the add: {spent}"
    );
    assert!(spent.section(Section::Read).all.count >= 1, "{spent}");
    assert!(spent.section(Section::Execute).all.count >= 2, "{spent}");
    assert!(spent.to_string().contains("share"), "{spent}");

    assert_eq!(profile::take(), profile::Profile::default(), "take resets");

    profile::enable(false);
    assert!(!profile::enabled());
    let y = x.scale(3.0).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.0, 6.0, 9.0]);
    let spent = profile::take();
    assert_eq!(
        spent,
        profile::Profile::default(),
        "nothing timed while off: {spent}"
    );
    assert_eq!(spent.to_string(), "nothing timed");
}
