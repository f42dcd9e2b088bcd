//! A guest driver in miniature for the unit tests: guest RAM, register accesses, split rings
//! laid out in that RAM, and an interrupt line that counts.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_DRIVER_FEATURES, VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
    VIRTIO_MMIO_QUEUE_AVAIL_LOW, VIRTIO_MMIO_QUEUE_DESC_HIGH, VIRTIO_MMIO_QUEUE_DESC_LOW,
    VIRTIO_MMIO_QUEUE_NUM, VIRTIO_MMIO_QUEUE_READY, VIRTIO_MMIO_QUEUE_SEL,
    VIRTIO_MMIO_QUEUE_USED_HIGH, VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_STATUS,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vm_superio::Trigger;

use super::mmio::{MmioTransport, VirtioDevice};

/// Guest RAM of the tests: 1 MiB from address 0.
pub const RAM_SIZE: u64 = 0x10_0000;
/// Where test buffers go (rings live below).
pub const BUFFERS: u64 = 0x8_0000;

pub fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM_SIZE as usize)]).unwrap()
}

/// An interrupt line counting how often it was raised.
#[derive(Debug, Clone, Default)]
pub struct CountingIrq(pub Rc<Cell<u32>>);

impl Trigger for CountingIrq {
    type E = ();
    fn trigger(&self) -> Result<(), ()> {
        self.0.set(self.0.get() + 1);
        Ok(())
    }
}

pub fn write_reg<D: VirtioDevice, T: Trigger>(
    t: &mut MmioTransport<D, T>,
    mem: &GuestMemoryMmap,
    offset: u32,
    value: u32,
) {
    t.write(u64::from(offset), &value.to_le_bytes(), mem);
}

pub fn read_reg<D: VirtioDevice, T: Trigger>(t: &mut MmioTransport<D, T>, offset: u32) -> u32 {
    let mut b = [0u8; 4];
    t.read(u64::from(offset), &mut b);
    u32::from_le_bytes(b)
}

/// ACKNOWLEDGE, DRIVER, the features, FEATURES_OK; returns Status as read back.
pub fn negotiate<D: VirtioDevice, T: Trigger>(
    t: &mut MmioTransport<D, T>,
    mem: &GuestMemoryMmap,
    features: u64,
) -> u32 {
    write_reg(t, mem, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
    write_reg(
        t,
        mem,
        VIRTIO_MMIO_STATUS,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
    );
    for sel in 0..2u32 {
        write_reg(t, mem, VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
        write_reg(
            t,
            mem,
            VIRTIO_MMIO_DRIVER_FEATURES,
            (features >> (32 * sel)) as u32,
        );
    }
    write_reg(
        t,
        mem,
        VIRTIO_MMIO_STATUS,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
    );
    read_reg(t, VIRTIO_MMIO_STATUS)
}

/// The driver's view of one split queue laid out in guest RAM.
#[derive(Debug, Clone)]
pub struct DriverQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    next_desc: u16,
    avail_idx: u16,
}

impl DriverQueue {
    /// Queue `index` of `size` entries at its fixed place in RAM (64 KiB apart from 64 KiB).
    pub fn at(index: u16, size: u16) -> Self {
        let desc = 0x1_0000 * (u64::from(index) + 1);
        Self {
            size,
            desc,
            avail: desc + 0x1000,
            used: desc + 0x2000,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Programs this queue's size and addresses and sets it ready.
    pub fn set_up<D: VirtioDevice, T: Trigger>(
        &self,
        t: &mut MmioTransport<D, T>,
        mem: &GuestMemoryMmap,
        index: u16,
    ) {
        write_reg(t, mem, VIRTIO_MMIO_QUEUE_SEL, index.into());
        write_reg(t, mem, VIRTIO_MMIO_QUEUE_NUM, self.size.into());
        for (low, high, addr) in [
            (
                VIRTIO_MMIO_QUEUE_DESC_LOW,
                VIRTIO_MMIO_QUEUE_DESC_HIGH,
                self.desc,
            ),
            (
                VIRTIO_MMIO_QUEUE_AVAIL_LOW,
                VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
                self.avail,
            ),
            (
                VIRTIO_MMIO_QUEUE_USED_LOW,
                VIRTIO_MMIO_QUEUE_USED_HIGH,
                self.used,
            ),
        ] {
            write_reg(t, mem, low, addr as u32);
            write_reg(t, mem, high, (addr >> 32) as u32);
        }
        write_reg(t, mem, VIRTIO_MMIO_QUEUE_READY, 1);
    }

    /// Writes descriptor `index` as is.
    pub fn write_desc(&self, mem: &GuestMemoryMmap, index: u16, desc: Descriptor) {
        mem.write_obj(desc, GuestAddress(self.desc + 16 * u64::from(index)))
            .unwrap();
    }

    /// Puts `head` in the available ring and publishes it.
    pub fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        mem.write_obj(head.to_le(), GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(mem, self.avail_idx);
    }

    /// Writes the available ring's idx (a driver lying about it, in hostile tests).
    pub fn set_avail_idx(&self, mem: &GuestMemoryMmap, idx: u16) {
        mem.store(idx.to_le(), GuestAddress(self.avail + 2), Ordering::Release)
            .unwrap();
    }

    /// Adds a chain of `(address, length, device-writable)` buffers and publishes it;
    /// returns its head.
    pub fn add(&mut self, mem: &GuestMemoryMmap, buffers: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in buffers.iter().enumerate() {
            let index = self.next_desc;
            let mut flags = if writable { VRING_DESC_F_WRITE } else { 0 } as u16;
            if i + 1 < buffers.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            self.write_desc(mem, index, Descriptor::new(addr, len, flags, index + 1));
            self.next_desc = (self.next_desc + 1) % self.size;
        }
        self.publish(mem, head);
        head
    }

    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.load(GuestAddress(self.used + 2), Ordering::Acquire)
            .unwrap()
    }

    /// Used ring entry `i`: (id, len).
    pub fn used(&self, mem: &GuestMemoryMmap, i: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * u64::from(i % self.size);
        (
            mem.read_obj(GuestAddress(at)).unwrap(),
            mem.read_obj(GuestAddress(at + 4)).unwrap(),
        )
    }

    /// EVENT_IDX: the driver's used_event (interrupt me when used passes it).
    pub fn set_used_event(&self, mem: &GuestMemoryMmap, value: u16) {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        mem.write_obj(value, GuestAddress(at)).unwrap();
    }

    /// EVENT_IDX: the device's avail_event (notify me when avail passes it).
    pub fn avail_event(&self, mem: &GuestMemoryMmap) -> u16 {
        let at = self.used + 4 + 8 * u64::from(self.size);
        mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// The available ring's flags (NO_INTERRUPT).
    pub fn set_avail_flags(&self, mem: &GuestMemoryMmap, flags: u16) {
        mem.write_obj(flags, GuestAddress(self.avail)).unwrap();
    }
}

/// Negotiates `features`, sets up one queue of `size` per device queue, and sets DRIVER_OK.
pub fn start<D: VirtioDevice, T: Trigger>(
    t: &mut MmioTransport<D, T>,
    mem: &GuestMemoryMmap,
    features: u64,
    size: u16,
) -> Vec<DriverQueue> {
    let status = negotiate(t, mem, features);
    assert_eq!(
        status & VIRTIO_CONFIG_S_FEATURES_OK,
        VIRTIO_CONFIG_S_FEATURES_OK
    );
    let count = t.queues().len() as u16;
    let queues: Vec<_> = (0..count)
        .map(|i| {
            let q = DriverQueue::at(i, size);
            q.set_up(t, mem, i);
            q
        })
        .collect();
    write_reg(
        t,
        mem,
        VIRTIO_MMIO_STATUS,
        status | VIRTIO_CONFIG_S_DRIVER_OK,
    );
    queues
}
