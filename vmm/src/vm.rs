//! One KVM virtual machine with its RAM, its single vCPU and its port devices.
//!
//! [`Machine::create`] does the VM-level setup in the order this platform needs: guest memory
//! is registered *before* the in-kernel irqchip exists (on kvm_pvm the memory-region ioctl
//! took 11.5 ms after `KVM_CREATE_IRQCHIP` and microseconds before it), then the TSS and
//! identity-map pages (VMX needs them; harmless elsewhere), the irqchip, the PIT, the vCPU,
//! the serial IRQ line and, for a VM with a network card, the card's IRQ line and the card
//! ([`crate::net`]). Boot and clone both start from here.
//!
//! [`Machine::forget_mappings`] deletes and re-adds the RAM slot, which makes KVM drop
//! everything it derived from guest memory (a reset needs it under shadow paging).

use std::time::Duration;

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::PortBus;
use crate::devices::console::ConsoleLog;
use crate::devices::virtio::net::NetDeviceState;
use crate::layout::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS, SERIAL_IRQ, VIRTIO_NET_IRQ};
use crate::memory::GuestRam;
use crate::vcpu::{self, Kicker, VcpuError, VcpuStop};

/// Errors of VM setup, one per ioctl.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(kvm_ioctls::Error),
    #[error("KVM_CREATE_VM failed: {0}")]
    CreateVm(kvm_ioctls::Error),
    #[error("KVM_SET_USER_MEMORY_REGION failed: {0}")]
    SetMemoryRegion(kvm_ioctls::Error),
    #[error("KVM_SET_USER_MEMORY_REGION (deleting the RAM slot) failed: {0}")]
    DeleteMemoryRegion(kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR failed: {0}")]
    SetTssAddress(kvm_ioctls::Error),
    #[error("KVM_SET_IDENTITY_MAP_ADDR failed: {0}")]
    SetIdentityMap(kvm_ioctls::Error),
    #[error("KVM_CREATE_IRQCHIP failed: {0}")]
    CreateIrqchip(kvm_ioctls::Error),
    #[error("KVM_CREATE_PIT2 failed: {0}")]
    CreatePit(kvm_ioctls::Error),
    #[error("KVM_CREATE_VCPU failed: {0}")]
    CreateVcpu(kvm_ioctls::Error),
    #[error("cannot create the serial IRQ eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("KVM_IRQFD for the serial IRQ failed: {0}")]
    RegisterIrqfd(kvm_ioctls::Error),
    #[error("KVM_IRQFD (deassigning the serial IRQ) failed: {0}")]
    UnregisterIrqfd(kvm_ioctls::Error),
    #[error("cannot create the network card's IRQ eventfd: {0}")]
    NetEventFd(std::io::Error),
    #[error("KVM_IRQFD for the network card's IRQ failed: {0}")]
    RegisterNetIrqfd(kvm_ioctls::Error),
    #[error("KVM_IRQFD (deassigning the network card's IRQ) failed: {0}")]
    UnregisterNetIrqfd(kvm_ioctls::Error),
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error(transparent)]
    Device(#[from] crate::devices::DeviceError),
}

/// Opens `/dev/kvm`.
pub fn open_kvm() -> Result<Kvm, VmError> {
    Kvm::new().map_err(VmError::OpenKvm)
}

/// A VM, its vCPU, RAM and port devices. Fields drop in order: vCPU, VM, devices, then RAM.
#[derive(Debug)]
pub struct Machine {
    pub vcpu: VcpuFd,
    pub vm: VmFd,
    pub bus: PortBus,
    pub ram: GuestRam,
    pub(crate) kicker: Kicker,
    /// KVM's counters of the vCPU (None when this KVM has no statistics file).
    pub(crate) stats: Option<crate::kvm_stats::VcpuStats>,
}

/// KVM memory slot of guest RAM (the only slot).
const RAM_SLOT: u32 = 0;

/// Registers `ram` as guest-physical `0..len`.
fn add_ram_slot(vm: &VmFd, ram: &GuestRam) -> Result<(), VmError> {
    let region = kvm_userspace_memory_region {
        slot: RAM_SLOT,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: ram.len(),
        userspace_addr: ram.host_address(),
    };
    // SAFETY: the region describes `ram`'s live mapping, which the `Machine` owns and drops
    // only after the VM (field order), so the guest never sees freed host memory.
    unsafe { vm.set_user_memory_region(region) }.map_err(VmError::SetMemoryRegion)
}

/// Whether a new machine has a network card, and how it starts.
#[derive(Debug, Clone, Copy)]
pub enum NetStart<'a> {
    /// No card (the default: no route out).
    None,
    /// A card in its reset state (a boot: the guest's driver sets it up).
    Fresh,
    /// A card continuing from a snapshot.
    Restore(&'a NetDeviceState),
}

impl<'a> NetStart<'a> {
    /// A clone of a machine whose captured card state is `state`.
    pub fn from_state(state: Option<&'a NetDeviceState>) -> Self {
        state.map_or(Self::None, Self::Restore)
    }
}

/// How the serial device of a new machine starts.
#[derive(Debug)]
pub enum SerialStart<'a> {
    /// Power-on state.
    Fresh,
    /// Continue from a snapshot.
    Restore(&'a vm_superio::serial::SerialState),
}

impl Machine {
    /// Creates the VM around `ram` with one vCPU (not yet configured) and the port devices.
    pub fn create(
        kvm: &Kvm,
        ram: GuestRam,
        console: ConsoleLog,
        serial: SerialStart<'_>,
        net: NetStart<'_>,
    ) -> Result<Self, VmError> {
        let vm = kvm.create_vm().map_err(VmError::CreateVm)?;
        add_ram_slot(&vm, &ram)?;
        vm.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(VmError::SetTssAddress)?;
        vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(VmError::SetIdentityMap)?;
        vm.create_irq_chip().map_err(VmError::CreateIrqchip)?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit).map_err(VmError::CreatePit)?;
        let vcpu = vm.create_vcpu(0).map_err(VmError::CreateVcpu)?;
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::EventFd)?;
        vm.register_irqfd(&irq, SERIAL_IRQ)
            .map_err(VmError::RegisterIrqfd)?;
        let mut bus = match serial {
            SerialStart::Fresh => PortBus::new(irq, console),
            SerialStart::Restore(state) => PortBus::from_state(irq, console, state)?,
        };
        let kicker = Kicker::new();
        let card_state = match net {
            NetStart::None => None,
            NetStart::Fresh => Some(None),
            NetStart::Restore(state) => Some(Some(state)),
        };
        if let Some(state) = card_state {
            let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::NetEventFd)?;
            vm.register_irqfd(&irq, VIRTIO_NET_IRQ)
                .map_err(VmError::RegisterNetIrqfd)?;
            bus.set_nic(crate::net::Nic::new(irq, kicker.clone(), state, &ram)?);
        }
        let stats = crate::kvm_stats::VcpuStats::open(&vcpu);
        Ok(Self {
            vcpu,
            vm,
            bus,
            ram,
            kicker,
            stats,
        })
    }

    /// Deletes and re-adds the RAM slot, which makes KVM drop every mapping it derived from
    /// guest memory: on a shadow-paging MMU (kvm_pvm, or hardware without EPT/NPT) the
    /// shadow page tables built from the guest's page tables, which host-side writes into
    /// guest page-table pages would otherwise leave stale. The guest refaults what it touches.
    pub(crate) fn forget_mappings(&self) -> Result<(), VmError> {
        let gone = kvm_userspace_memory_region {
            slot: RAM_SLOT,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: 0,
            userspace_addr: self.ram.host_address(),
        };
        // SAFETY: a zero-sized region deletes the slot; KVM stops using the mapping.
        unsafe { self.vm.set_user_memory_region(gone) }.map_err(VmError::DeleteMemoryRegion)?;
        add_ram_slot(&self.vm, &self.ram)
    }

    /// Makes sure no device interrupt is still on its way into the irqchip. KVM injects an
    /// irqfd's interrupt from a work item, so a serial interrupt the guest caused at the end
    /// of a job can land after a reset restored the irqchip. Deassigning the irqfd waits for
    /// that work; the eventfd's count is then drained and the irqfd assigned again.
    pub(crate) fn quiesce_irqs(&self) -> Result<(), VmError> {
        self.quiesce_irq(
            self.bus.serial_irq(),
            SERIAL_IRQ,
            VmError::UnregisterIrqfd,
            VmError::RegisterIrqfd,
        )?;
        if let Some(nic) = self.bus.nic() {
            self.quiesce_irq(
                nic.irq(),
                VIRTIO_NET_IRQ,
                VmError::UnregisterNetIrqfd,
                VmError::RegisterNetIrqfd,
            )?;
        }
        Ok(())
    }

    /// [`Self::quiesce_irqs`] for one irqfd: deassign (waits for KVM's injection work),
    /// drain the count, assign again.
    fn quiesce_irq(
        &self,
        irq: &EventFd,
        gsi: u32,
        unregister: fn(kvm_ioctls::Error) -> VmError,
        register: fn(kvm_ioctls::Error) -> VmError,
    ) -> Result<(), VmError> {
        self.vm.unregister_irqfd(irq, gsi).map_err(unregister)?;
        // Non-blocking: EAGAIN when nothing is pending, which is as good as a drained count.
        let _ = irq.read();
        self.vm.register_irqfd(irq, gsi).map_err(register)?;
        Ok(())
    }

    /// Decides the network card's names and connections from now on (a machine without a
    /// card ignores it).
    pub fn set_egress(&mut self, egress: std::sync::Arc<dyn crate::net::Egress>) {
        if let Some(nic) = self.bus.nic_mut() {
            nic.set_egress(egress);
        }
    }

    /// Runs the vCPU until it stops, or until `timeout` passes (then [`VcpuStop::Kicked`]).
    pub fn run_for(&mut self, timeout: Duration) -> Result<VcpuStop, VcpuError> {
        let _deadline = crate::timer::arm(std::time::Instant::now() + timeout, self.kicker.clone());
        vcpu::run(&mut self.vcpu, &mut self.bus, &self.ram, &self.kicker)
    }
}
