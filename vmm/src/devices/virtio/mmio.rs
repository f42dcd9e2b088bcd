//! The virtio 1.x MMIO transport ("virtio-mmio" version 2): the register file a guest driver
//! sees in a device's MMIO window, over any [`VirtioDevice`].
//!
//! Registers (offsets in the window, all 32-bit, little-endian): MagicValue 0x000 ("virt"),
//! Version 0x004 (2: modern only), DeviceID 0x008, VendorID 0x00c, DeviceFeatures 0x010 with
//! DeviceFeaturesSel 0x014, DriverFeatures 0x020 with DriverFeaturesSel 0x024, QueueSel 0x030,
//! QueueNumMax 0x034, QueueNum 0x038, QueueReady 0x044, QueueNotify 0x050, InterruptStatus
//! 0x060, InterruptACK 0x064, Status 0x070, QueueDesc 0x080/0x084, QueueDriver (avail ring)
//! 0x090/0x094, QueueDevice (used ring) 0x0a0/0x0a4, SHMSel 0x0ac with SHMLen/SHMBase
//! 0x0b0..0x0bc (no shared memory regions: all-ones), ConfigGeneration 0x0fc; the device's
//! configuration space from 0x100 (read-only here, any access width). The legacy (version 1)
//! registers GuestPageSize, QueueAlign and QueuePFN do not exist in version 2 and are bad
//! accesses.
//!
//! The driver's path, which the transport enforces: reset (Status 0) -> ACKNOWLEDGE -> DRIVER ->
//! write the features it takes -> FEATURES_OK (refused, i.e. not set, unless the features are a
//! subset of the offer and include VERSION_1) -> set up each queue (size, three ring addresses,
//! QueueReady 1; only between FEATURES_OK and DRIVER_OK) -> DRIVER_OK (the device is activated
//! with the negotiated features). Status bits are only ever added, in that order, until a 0
//! resets everything; FAILED may be set at any time. What breaks the rules is handled as the
//! parent module's doc says: ignored and counted, or the device is marked broken.
//!
//! Interrupts: the transport keeps InterruptStatus (bit 0 used buffer, bit 1 config change) and
//! raises its line through a `vm_superio::Trigger` (bud's `IrqEvent`, an irqfd, once wired).
//!
//! Snapshots: [`TransportState`] is the whole guest-visible state by value (the registers and
//! each queue's `virtio_queue::QueueState`); [`MmioTransport::restore`] validates it before
//! taking it. Counters are diagnostics, not state: a restore zeroes them.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_CONFIG, VIRTIO_MMIO_CONFIG_GENERATION, VIRTIO_MMIO_DEVICE_FEATURES,
    VIRTIO_MMIO_DEVICE_FEATURES_SEL, VIRTIO_MMIO_DEVICE_ID, VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
    VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INTERRUPT_STATUS, VIRTIO_MMIO_MAGIC_VALUE,
    VIRTIO_MMIO_QUEUE_AVAIL_HIGH, VIRTIO_MMIO_QUEUE_AVAIL_LOW, VIRTIO_MMIO_QUEUE_DESC_HIGH,
    VIRTIO_MMIO_QUEUE_DESC_LOW, VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_QUEUE_NUM,
    VIRTIO_MMIO_QUEUE_NUM_MAX, VIRTIO_MMIO_QUEUE_READY, VIRTIO_MMIO_QUEUE_SEL,
    VIRTIO_MMIO_QUEUE_USED_HIGH, VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_SHM_BASE_HIGH,
    VIRTIO_MMIO_SHM_BASE_LOW, VIRTIO_MMIO_SHM_LEN_HIGH, VIRTIO_MMIO_SHM_LEN_LOW,
    VIRTIO_MMIO_SHM_SEL, VIRTIO_MMIO_STATUS, VIRTIO_MMIO_VENDOR_ID, VIRTIO_MMIO_VERSION,
};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemory};
use vm_superio::Trigger;

use super::DeviceFault;

/// MagicValue: "virt" in little-endian.
pub const MAGIC_VALUE: u32 = 0x7472_6976;
/// Version: 2, the virtio 1.x (non-legacy) MMIO transport.
pub const MMIO_VERSION: u32 = 2;
/// VendorID bud reports: "bud" in little-endian.
pub const VENDOR_ID: u32 = 0x0064_7562;
/// Size of a device's MMIO window (registers, then the config space).
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;

/// The status bits a driver may set (NEEDS_RESET is the device's).
const DRIVER_STATUS_BITS: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE
    | VIRTIO_CONFIG_S_DRIVER
    | VIRTIO_CONFIG_S_FEATURES_OK
    | VIRTIO_CONFIG_S_DRIVER_OK
    | VIRTIO_CONFIG_S_FAILED;

/// A device model behind the transport: what it offers, its config space, and what it does
/// when the driver starts, stops or notifies it.
pub trait VirtioDevice {
    /// The virtio device ID (1 for a network card).
    fn device_id(&self) -> u32;
    /// The feature bits offered (transport bits such as VERSION_1 included).
    fn device_features(&self) -> u64;
    /// The maximum size of each of the device's queues (its queue count is this length).
    fn queue_max_sizes(&self) -> &[u16];
    /// The device's configuration space, as the driver reads it from offset 0x100.
    fn config_space(&self) -> &[u8];
    /// The driver set DRIVER_OK having negotiated `features` (or a snapshot was restored in
    /// that state).
    fn activate(&mut self, features: u64);
    /// The driver reset the device (or a snapshot was restored into an unstarted one).
    fn reset(&mut self);
    /// The driver notified queue `index` (a ready queue of a running device). Returns whether
    /// the driver should get a used-buffer interrupt.
    fn queue_notify<M: GuestMemory>(
        &mut self,
        index: u16,
        queues: &mut [Queue],
        mem: &M,
    ) -> Result<bool, DeviceFault>;
}

/// Diagnostic counters of one transport (not part of its state).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TransportCounters {
    /// Accesses ignored as meaningless: wrong width or alignment, unknown or read-only
    /// registers, reads past the config space, writes in a state where they mean nothing.
    pub bad_accesses: u64,
    /// Times the device was marked broken (each [`DeviceFault`]).
    pub faults: u64,
    /// Interrupts that could not be raised (the trigger failed).
    pub irq_errors: u64,
}

/// A serde mirror of `virtio_queue::QueueState` (which derives no serde; `virtio-queue-ser`
/// pins an older virtio-queue and vm-memory). A field added to or changed in `QueueState`
/// fails to compile here, as `snapshot::SerialStateDef` does for the serial console.
#[derive(Serialize, Deserialize)]
#[serde(remote = "QueueState")]
struct QueueStateDef {
    max_size: u16,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
}

/// One queue's state, serializable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedQueue(#[serde(with = "QueueStateDef")] pub QueueState);

/// The guest-visible state of a transport, by value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    /// The features the driver wrote (the negotiated set once FEATURES_OK is set).
    pub driver_features: u64,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<SavedQueue>,
}

/// Why a [`TransportState`] cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("the state has {found} queues, the device has {expected}")]
    QueueCount { found: usize, expected: usize },
    #[error("queue {queue}: maximum size {found}, the device's is {expected}")]
    QueueMaxSize {
        queue: usize,
        found: u16,
        expected: u16,
    },
    #[error("queue {queue}: invalid state: {detail}")]
    Queue { queue: usize, detail: String },
    #[error("queue {queue} is ready but its rings are not inside guest RAM")]
    RingOutsideMemory { queue: usize },
    #[error("status {0:#x} has bits no driver or device sets")]
    Status(u32),
    #[error("features {found:#x} are not a subset of the offer {offered:#x}")]
    Features { found: u64, offered: u64 },
}

/// The virtio-MMIO register file over device `D`, raising interrupts through `T`.
#[derive(Debug)]
pub struct MmioTransport<D, T> {
    device: D,
    irq: T,
    queues: Vec<Queue>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    interrupt_status: u32,
    config_generation: u32,
    counters: TransportCounters,
    last_fault: Option<DeviceFault>,
}

impl<D: VirtioDevice, T: Trigger> MmioTransport<D, T> {
    /// A transport in the reset state over `device`.
    ///
    /// # Panics
    /// If the device offers a queue whose maximum size is 0, not a power of two, or above
    /// 32768 (a bug in the device model, not guest input).
    pub fn new(device: D, irq: T) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).expect("device offers a valid queue maximum size"))
            .collect();
        Self {
            device,
            irq,
            queues,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            interrupt_status: 0,
            config_generation: 0,
            counters: TransportCounters::default(),
            last_fault: None,
        }
    }

    /// The device behind the transport.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device behind the transport, mutably.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The interrupt trigger (its eventfd is registered with KVM).
    pub fn irq(&self) -> &T {
        &self.irq
    }

    /// The queues (for inspection).
    pub fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// The Status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The InterruptStatus register.
    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    /// The features negotiated (what the driver wrote; meaningful once FEATURES_OK is set).
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// Diagnostic counters.
    pub fn counters(&self) -> TransportCounters {
        self.counters
    }

    /// Why the device was last marked broken, if it was.
    pub fn last_fault(&self) -> Option<&DeviceFault> {
        self.last_fault.as_ref()
    }

    /// Whether the driver has the device running (DRIVER_OK) and it is not broken.
    pub fn is_running(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && self.status & VIRTIO_CONFIG_S_NEEDS_RESET == 0
    }

    /// A guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        let Some(reg) = register_access(offset, data.len()) else {
            self.counters.bad_accesses += 1;
            return;
        };
        let value = match reg {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC_VALUE,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_id(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.device_features() as u32,
                1 => (self.device.device_features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            // No shared memory regions: every region's length and base read as all-ones.
            VIRTIO_MMIO_SHM_LEN_LOW
            | VIRTIO_MMIO_SHM_LEN_HIGH
            | VIRTIO_MMIO_SHM_BASE_LOW
            | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            _ => {
                self.counters.bad_accesses += 1;
                0
            }
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// A guest write of `data` at `offset` in the window. A QueueNotify runs the device's
    /// queue processing here (the fallback path; once wired, notifications arrive through an
    /// ioeventfd and [`MmioTransport::notify`]).
    pub fn write<M: GuestMemory>(&mut self, offset: u64, data: &[u8], mem: &M) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            // No config field of bud's devices is writable.
            self.counters.bad_accesses += 1;
            return;
        }
        let Some(reg) = register_access(offset, data.len()) else {
            self.counters.bad_accesses += 1;
            return;
        };
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(data);
        let value = u32::from_le_bytes(bytes);
        match reg {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(value),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            VIRTIO_MMIO_QUEUE_NUM => self.setup_queue(|q, index| {
                u16::try_from(value)
                    .ok()
                    .and_then(|size| q.try_set_size(size).ok())
                    .ok_or(DeviceFault::QueueSize {
                        queue: index,
                        size: value,
                    })
            }),
            VIRTIO_MMIO_QUEUE_READY => self.write_queue_ready(value, mem),
            VIRTIO_MMIO_QUEUE_DESC_LOW | VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                self.write_ring_address(Ring::Desc, reg == VIRTIO_MMIO_QUEUE_DESC_HIGH, value)
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW | VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.write_ring_address(Ring::Avail, reg == VIRTIO_MMIO_QUEUE_AVAIL_HIGH, value)
            }
            VIRTIO_MMIO_QUEUE_USED_LOW | VIRTIO_MMIO_QUEUE_USED_HIGH => {
                self.write_ring_address(Ring::Used, reg == VIRTIO_MMIO_QUEUE_USED_HIGH, value)
            }
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(value, mem),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !value,
            VIRTIO_MMIO_STATUS => self.write_status(value),
            // Selects a shared memory region; there are none, so any selection is fine.
            VIRTIO_MMIO_SHM_SEL => {}
            _ => self.counters.bad_accesses += 1,
        }
    }

    /// The driver notified queue `index` (QueueNotify's value): the device processes it if it
    /// is running and the queue is ready, and the driver is interrupted if the device says so.
    pub fn notify<M: GuestMemory>(&mut self, index: u32, mem: &M) {
        let Some(index) = u16::try_from(index)
            .ok()
            .filter(|&i| self.queues.get(usize::from(i)).is_some_and(Queue::ready))
        else {
            self.counters.bad_accesses += 1;
            return;
        };
        if !self.is_running() {
            self.counters.bad_accesses += 1;
            return;
        }
        let _ = self.run(mem, |device, queues, mem| {
            device
                .queue_notify(index, queues, mem)
                .map(|signal| ((), signal))
        });
    }

    /// Runs `f` over the device and its queues if the device is running; `f` returns its
    /// result and whether the driver should get a used-buffer interrupt. A fault marks the
    /// device broken. `None` if the device was not running or `f` faulted.
    pub fn run<M: GuestMemory, R>(
        &mut self,
        mem: &M,
        f: impl FnOnce(&mut D, &mut [Queue], &M) -> Result<(R, bool), DeviceFault>,
    ) -> Option<R> {
        if !self.is_running() {
            return None;
        }
        match f(&mut self.device, &mut self.queues, mem) {
            Ok((result, signal)) => {
                if signal {
                    self.raise(VIRTIO_MMIO_INT_VRING);
                }
                Some(result)
            }
            Err(fault) => {
                self.fault(fault);
                None
            }
        }
    }

    /// The transport's state by value (for snapshots and resets).
    pub fn state(&self) -> TransportState {
        TransportState {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt_status,
            config_generation: self.config_generation,
            queues: self.queues.iter().map(|q| SavedQueue(q.state())).collect(),
        }
    }

    /// Returns the transport to `state` (checked first; on error nothing changes), zeroes the
    /// counters, and activates or resets the device to match. Ready queues must lie in `mem`.
    pub fn restore<M: GuestMemory>(
        &mut self,
        state: &TransportState,
        mem: &M,
    ) -> Result<(), StateError> {
        let max_sizes = self.device.queue_max_sizes();
        if state.queues.len() != max_sizes.len() {
            return Err(StateError::QueueCount {
                found: state.queues.len(),
                expected: max_sizes.len(),
            });
        }
        if state.status & !(DRIVER_STATUS_BITS | VIRTIO_CONFIG_S_NEEDS_RESET) != 0 {
            return Err(StateError::Status(state.status));
        }
        // Before FEATURES_OK the driver may have written anything (the device then refuses
        // FEATURES_OK); after it, only a subset of the offer can have been accepted.
        let offered = self.device.device_features();
        if state.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 && state.driver_features & !offered != 0
        {
            return Err(StateError::Features {
                found: state.driver_features,
                offered,
            });
        }
        let mut queues = Vec::with_capacity(max_sizes.len());
        for (i, (saved, &max)) in state.queues.iter().zip(max_sizes).enumerate() {
            if saved.0.max_size != max {
                return Err(StateError::QueueMaxSize {
                    queue: i,
                    found: saved.0.max_size,
                    expected: max,
                });
            }
            let queue = Queue::try_from(saved.0).map_err(|e| StateError::Queue {
                queue: i,
                detail: e.to_string(),
            })?;
            if queue.ready() && !queue.is_valid(mem) {
                return Err(StateError::RingOutsideMemory { queue: i });
            }
            queues.push(queue);
        }
        self.queues = queues;
        self.status = state.status;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.driver_features = state.driver_features;
        self.queue_sel = state.queue_sel;
        self.interrupt_status = state.interrupt_status;
        self.config_generation = state.config_generation;
        self.counters = TransportCounters::default();
        self.last_fault = None;
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.device.activate(self.driver_features);
        } else {
            self.device.reset();
        }
        Ok(())
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.selected_index().map(|i| &self.queues[usize::from(i)])
    }

    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        let config = self.device.config_space();
        let end = offset.checked_add(data.len() as u64);
        match end {
            Some(end) if end <= config.len() as u64 && matches!(data.len(), 1 | 2 | 4 | 8) => {
                data.copy_from_slice(&config[offset as usize..end as usize]);
            }
            _ => self.counters.bad_accesses += 1,
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        let negotiating = self.status & VIRTIO_CONFIG_S_DRIVER != 0
            && self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0;
        match self.driver_features_sel {
            0 if negotiating => {
                self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value);
            }
            1 if negotiating => {
                self.driver_features =
                    (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32);
            }
            _ => self.counters.bad_accesses += 1,
        }
    }

    /// Runs `f` on the selected queue if the driver may set it up now (after FEATURES_OK,
    /// before DRIVER_OK, the queue not ready, the device not broken). No queue selected:
    /// ignored; the wrong state or an error from `f`: the device is broken.
    fn setup_queue(&mut self, f: impl FnOnce(&mut Queue, u16) -> Result<(), DeviceFault>) {
        let status = self.status;
        let in_setup = status & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && status & (VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_NEEDS_RESET) == 0;
        let Some(index) = self.selected_index() else {
            self.counters.bad_accesses += 1;
            return;
        };
        let queue = &mut self.queues[usize::from(index)];
        let result = if in_setup && !queue.ready() {
            f(queue, index)
        } else {
            Err(DeviceFault::QueueSetupState {
                queue: index,
                status,
            })
        };
        if let Err(fault) = result {
            self.fault(fault);
        }
    }

    /// QueueSel, if it names one of the device's queues.
    fn selected_index(&self) -> Option<u16> {
        u16::try_from(self.queue_sel)
            .ok()
            .filter(|&i| usize::from(i) < self.queues.len())
    }

    fn write_ring_address(&mut self, ring: Ring, high: bool, value: u32) {
        self.setup_queue(|q, index| {
            let current = match ring {
                Ring::Desc => q.desc_table(),
                Ring::Avail => q.avail_ring(),
                Ring::Used => q.used_ring(),
            };
            let addr = if high {
                (current & 0xffff_ffff) | (u64::from(value) << 32)
            } else {
                (current & !0xffff_ffff) | u64::from(value)
            };
            let set = match ring {
                Ring::Desc => q.try_set_desc_table_address(GuestAddress(addr)),
                Ring::Avail => q.try_set_avail_ring_address(GuestAddress(addr)),
                Ring::Used => q.try_set_used_ring_address(GuestAddress(addr)),
            };
            set.map_err(|_| DeviceFault::RingAlignment {
                queue: index,
                what: ring.name(),
                addr,
            })
        });
    }

    fn write_queue_ready<M: GuestMemory>(&mut self, value: u32, mem: &M) {
        let Some(index) = self.selected_index() else {
            self.counters.bad_accesses += 1;
            return;
        };
        match value {
            1 => self.setup_queue(|q, index| {
                q.set_ready(true);
                if q.is_valid(mem) {
                    Ok(())
                } else {
                    q.set_ready(false);
                    Err(DeviceFault::RingOutsideMemory { queue: index })
                }
            }),
            // Taking a queue back before DRIVER_OK is allowed; after it, it needs
            // VIRTIO_F_RING_RESET, which is not offered.
            0 if self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0 => {
                self.queues[usize::from(index)].set_ready(false);
            }
            0 => self.fault(DeviceFault::QueueSetupState {
                queue: index,
                status: self.status,
            }),
            _ => self.counters.bad_accesses += 1,
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // Drivers write back what they read plus a bit, so NEEDS_RESET may come back: it stays
        // the device's.
        let old = self.status & DRIVER_STATUS_BITS;
        let mut new = value & !VIRTIO_CONFIG_S_NEEDS_RESET;
        let in_order = |s: u32| {
            let has = |bit| s & bit != 0;
            (!has(VIRTIO_CONFIG_S_DRIVER) || has(VIRTIO_CONFIG_S_ACKNOWLEDGE))
                && (!has(VIRTIO_CONFIG_S_FEATURES_OK) || has(VIRTIO_CONFIG_S_DRIVER))
                && (!has(VIRTIO_CONFIG_S_DRIVER_OK) || has(VIRTIO_CONFIG_S_FEATURES_OK))
        };
        if new & !DRIVER_STATUS_BITS != 0 || new & old != old || !in_order(new) {
            self.counters.bad_accesses += 1;
            return;
        }
        let added = new & !old;
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0 && !self.features_acceptable() {
            // The spec's way to refuse: FEATURES_OK does not stick, the driver reads it back.
            new &= !(VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK);
        }
        self.status = new | (self.status & VIRTIO_CONFIG_S_NEEDS_RESET);
        if added & VIRTIO_CONFIG_S_DRIVER_OK != 0 && new & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            let event_idx = self.driver_features
                & (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
                != 0;
            for q in &mut self.queues {
                q.set_event_idx(event_idx);
            }
            self.device.activate(self.driver_features);
        }
    }

    fn features_acceptable(&self) -> bool {
        self.driver_features & !self.device.device_features() == 0
            && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0
    }

    /// The driver wrote 0 to Status: everything back to its initial value (counters stay).
    fn reset(&mut self) {
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt_status = 0;
        self.config_generation = 0;
        self.device.reset();
    }

    fn fault(&mut self, fault: DeviceFault) {
        self.counters.faults += 1;
        self.last_fault = Some(fault);
        if self.status & VIRTIO_CONFIG_S_NEEDS_RESET == 0 {
            self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
                self.raise(VIRTIO_MMIO_INT_CONFIG);
            }
        }
    }

    fn raise(&mut self, bit: u32) {
        self.interrupt_status |= bit;
        if self.irq.trigger().is_err() {
            self.counters.irq_errors += 1;
        }
    }
}

/// The register a control-register access names, if it is a 32-bit aligned access.
fn register_access(offset: u64, len: usize) -> Option<u32> {
    (len == 4 && offset % 4 == 0)
        .then(|| u32::try_from(offset).ok())
        .flatten()
}

#[derive(Debug, Clone, Copy)]
enum Ring {
    Desc,
    Avail,
    Used,
}

impl Ring {
    fn name(self) -> &'static str {
        match self {
            Ring::Desc => "descriptor table",
            Ring::Avail => "available ring",
            Ring::Used => "used ring",
        }
    }
}

#[cfg(test)]
mod tests {
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_ACKNOWLEDGE as ACK;
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_DRIVER as DRIVER;
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_DRIVER_OK as DRIVER_OK;
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_FEATURES_OK as FEATURES_OK;
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET as NEEDS_RESET;
    use virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_PFN;

    use super::super::net::{NetConfig, OFFERED_FEATURES, TxChecksum, VirtioNet};
    use super::super::testing::{
        CountingIrq, DriverQueue, memory, negotiate, read_reg, start, write_reg,
    };
    use super::*;

    #[derive(Debug, Default)]
    struct NoSink;
    impl super::super::net::FrameSink for NoSink {
        fn transmit(&mut self, _: &[u8], _: TxChecksum) {}
    }

    fn transport() -> MmioTransport<VirtioNet<NoSink>, CountingIrq> {
        MmioTransport::new(
            VirtioNet::new(NetConfig::default(), NoSink),
            CountingIrq::default(),
        )
    }

    #[test]
    fn identity_registers_and_offered_features_read_as_the_spec_says() {
        let mem = memory();
        let mut t = transport();

        let magic = read_reg(&mut t, VIRTIO_MMIO_MAGIC_VALUE);
        let version = read_reg(&mut t, VIRTIO_MMIO_VERSION);
        let id = read_reg(&mut t, VIRTIO_MMIO_DEVICE_ID);
        let vendor = read_reg(&mut t, VIRTIO_MMIO_VENDOR_ID);
        let low = read_reg(&mut t, VIRTIO_MMIO_DEVICE_FEATURES);
        write_reg(&mut t, &mem, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        let high = read_reg(&mut t, VIRTIO_MMIO_DEVICE_FEATURES);
        write_reg(&mut t, &mem, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
        let beyond = read_reg(&mut t, VIRTIO_MMIO_DEVICE_FEATURES);
        let num_max = read_reg(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_SEL, 2);
        let no_queue = read_reg(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX);

        assert_eq!(magic, 0x7472_6976);
        assert_eq!(version, 2);
        assert_eq!(id, 1);
        assert_eq!(vendor, 0x0064_7562);
        // CSUM 0, GUEST_CSUM 1, MTU 3, MAC 5, MRG_RXBUF 15, RING_EVENT_IDX 29; VERSION_1 32.
        assert_eq!(low, 0x2000_802b);
        assert_eq!(high, 1);
        assert_eq!(beyond, 0);
        assert_eq!(num_max, 256);
        assert_eq!(no_queue, 0);
        assert_eq!(t.counters(), TransportCounters::default());
    }

    #[test]
    fn features_outside_the_offer_or_without_version_1_are_refused() {
        let mem = memory();
        let mut t = transport();

        let extra = negotiate(&mut t, &mem, OFFERED_FEATURES | (1 << 17));
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, 0);
        let legacy = negotiate(&mut t, &mem, OFFERED_FEATURES & !(1 << 32));
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, 0);
        let good = negotiate(&mut t, &mem, OFFERED_FEATURES);

        assert_eq!(extra, ACK | DRIVER);
        assert_eq!(legacy, ACK | DRIVER);
        assert_eq!(good, ACK | DRIVER | FEATURES_OK);
        assert_eq!(t.driver_features(), OFFERED_FEATURES);
    }

    #[test]
    fn status_bits_come_in_order_and_are_never_taken_back_without_a_reset() {
        let mem = memory();
        let mut t = transport();

        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, DRIVER);
        let driver_first = t.status();
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, ACK);
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, ACK | DRIVER | DRIVER_OK);
        let ok_early = t.status();
        write_reg(&mut t, &mem, VIRTIO_MMIO_DRIVER_FEATURES, 0xffff);
        let features_before_driver = t.driver_features();
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, ACK | DRIVER);
        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, ACK);
        let taken_back = t.status();

        assert_eq!(driver_first, 0);
        assert_eq!(ok_early, ACK);
        assert_eq!(features_before_driver, 0);
        assert_eq!(taken_back, ACK | DRIVER);
        assert_eq!(t.counters().bad_accesses, 4);
        assert_eq!(t.counters().faults, 0);
    }

    #[test]
    fn register_accesses_that_are_not_32_bit_and_aligned_or_name_no_register_are_ignored() {
        let mem = memory();
        let mut t = transport();
        let mut byte = [0xaa_u8; 1];
        let mut unaligned = [0xaa_u8; 4];

        t.read(0, &mut byte);
        t.read(2, &mut unaligned);
        t.write(u64::from(VIRTIO_MMIO_STATUS), &[1, 0], &mem);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_PFN, 0x10);
        let write_only = read_reg(&mut t, VIRTIO_MMIO_QUEUE_DESC_LOW);
        t.write(0x100, &[1], &mem);
        let mut past_config = [0xaa_u8; 4];
        t.read(0x100 + 10, &mut past_config);

        assert_eq!(byte, [0]);
        assert_eq!(unaligned, [0; 4]);
        assert_eq!(t.status(), 0);
        assert_eq!(write_only, 0);
        assert_eq!(past_config, [0; 4]);
        assert_eq!(t.counters().bad_accesses, 7);
        assert_eq!(t.counters().faults, 0);
    }

    #[test]
    fn there_are_no_shared_memory_regions() {
        let mem = memory();
        let mut t = transport();

        write_reg(&mut t, &mem, VIRTIO_MMIO_SHM_SEL, 0);
        let len = [VIRTIO_MMIO_SHM_LEN_LOW, VIRTIO_MMIO_SHM_LEN_HIGH].map(|r| read_reg(&mut t, r));
        let base =
            [VIRTIO_MMIO_SHM_BASE_LOW, VIRTIO_MMIO_SHM_BASE_HIGH].map(|r| read_reg(&mut t, r));

        assert_eq!(len, [u32::MAX; 2]);
        assert_eq!(base, [u32::MAX; 2]);
        assert_eq!(t.counters().bad_accesses, 0);
    }

    #[test]
    fn the_config_space_holds_the_mac_and_the_mtu_at_any_width() {
        let mut t = transport();
        let mut mac = [0u8; 6];
        let mut mtu = [0u8; 2];
        let mut mac_as_u32 = [0u8; 4];

        for (i, b) in mac.iter_mut().enumerate() {
            let mut one = [0u8; 1];
            t.read(0x100 + i as u64, &mut one);
            *b = one[0];
        }
        t.read(0x10a, &mut mtu);
        t.read(0x100, &mut mac_as_u32);

        assert_eq!(mac, [0x02, 0x42, 0x0a, 0x00, 0x02, 0x0f]);
        assert_eq!(u16::from_le_bytes(mtu), 65500);
        assert_eq!(mac_as_u32, [0x02, 0x42, 0x0a, 0x00]);
        assert_eq!(t.counters().bad_accesses, 0);
    }

    #[test]
    fn invalid_queue_sizes_break_the_device_until_a_reset() {
        let mem = memory();
        for size in [0u32, 100, 512, 0x1_0000] {
            let mut t = transport();
            negotiate(&mut t, &mem, OFFERED_FEATURES);

            write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_NUM, size);

            assert_eq!(
                t.last_fault(),
                Some(&DeviceFault::QueueSize { queue: 0, size })
            );
            assert_eq!(t.status(), ACK | DRIVER | FEATURES_OK | NEEDS_RESET);
            // Not running yet: no config interrupt.
            assert_eq!(t.interrupt_status(), 0);
            write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, 0);
            assert_eq!(t.status(), 0);
        }
    }

    #[test]
    fn unaligned_rings_and_rings_outside_ram_are_faults_and_the_queue_stays_unready() {
        let mem = memory();
        let mut t = transport();
        negotiate(&mut t, &mem, OFFERED_FEATURES);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_DESC_LOW, 0x1_0008);
        let unaligned = t.last_fault().cloned();

        let mut t = transport();
        negotiate(&mut t, &mem, OFFERED_FEATURES);
        let mut q = DriverQueue::at(0, 16);
        q.desc = 0x20_0000;
        q.set_up(&mut t, &mem, 0);
        let outside = t.last_fault().cloned();
        let ready = read_reg(&mut t, VIRTIO_MMIO_QUEUE_READY);

        assert_eq!(
            unaligned,
            Some(DeviceFault::RingAlignment {
                queue: 0,
                what: "descriptor table",
                addr: 0x1_0008
            })
        );
        assert_eq!(outside, Some(DeviceFault::RingOutsideMemory { queue: 0 }));
        assert_eq!(ready, 0);
        assert_eq!(t.counters().faults, 1);
    }

    #[test]
    fn queue_setup_after_driver_ok_breaks_a_running_device_with_a_config_interrupt() {
        let mem = memory();
        let mut t = transport();
        start(&mut t, &mem, OFFERED_FEATURES, 16);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_SEL, 0);

        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_NUM, 8);

        assert_eq!(
            t.last_fault(),
            Some(&DeviceFault::QueueSetupState {
                queue: 0,
                status: ACK | DRIVER | FEATURES_OK | DRIVER_OK
            })
        );
        assert_eq!(t.status() & NEEDS_RESET, NEEDS_RESET);
        assert_eq!(t.interrupt_status(), VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(t.queues()[0].size(), 16);
        assert!(!t.is_running());
    }

    #[test]
    fn queue_ready_takes_1_to_start_0_to_stop_before_driver_ok_and_ignores_other_values() {
        let mem = memory();
        let mut t = transport();
        negotiate(&mut t, &mem, OFFERED_FEATURES);
        let q = DriverQueue::at(0, 16);
        q.set_up(&mut t, &mem, 0);
        let started = read_reg(&mut t, VIRTIO_MMIO_QUEUE_READY);

        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_READY, 2);
        let after_two = read_reg(&mut t, VIRTIO_MMIO_QUEUE_READY);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_READY, 0);
        let stopped = read_reg(&mut t, VIRTIO_MMIO_QUEUE_READY);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_SEL, 7);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_READY, 1);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_NUM, 16);

        assert_eq!((started, after_two, stopped), (1, 1, 0));
        assert_eq!(t.counters().bad_accesses, 3);
        assert_eq!(t.counters().faults, 0);
    }

    #[test]
    fn a_device_broken_during_setup_stays_broken_when_the_driver_writes_status_back() {
        let mem = memory();
        let mut t = transport();
        negotiate(&mut t, &mem, OFFERED_FEATURES);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_NUM, 3);
        let broken = read_reg(&mut t, VIRTIO_MMIO_STATUS);

        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, broken | DRIVER_OK);

        assert_eq!(broken, ACK | DRIVER | FEATURES_OK | NEEDS_RESET);
        assert_eq!(t.status(), broken | DRIVER_OK);
        assert!(!t.is_running());
        assert_eq!(t.counters().faults, 1);
    }

    #[test]
    fn a_state_mid_negotiation_with_refused_features_restores_exactly() {
        let mem = memory();
        let mut t = transport();
        let status = negotiate(&mut t, &mem, OFFERED_FEATURES | (1 << 17));
        let state = t.state();

        let mut twin = transport();
        twin.restore(&state, &mem).unwrap();

        assert_eq!(status, ACK | DRIVER);
        assert_eq!(state.driver_features, OFFERED_FEATURES | (1 << 17));
        assert_eq!(twin.state(), state);
    }

    #[test]
    fn writing_status_zero_returns_every_register_and_queue_to_its_initial_value() {
        let mem = memory();
        let fresh = transport().state();
        let mut t = transport();
        start(&mut t, &mem, OFFERED_FEATURES, 16);
        write_reg(&mut t, &mem, VIRTIO_MMIO_QUEUE_SEL, 1);
        write_reg(&mut t, &mem, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);

        write_reg(&mut t, &mem, VIRTIO_MMIO_STATUS, 0);

        assert_eq!(t.state(), fresh);
    }
}
