//! The virtio-net device behind its virtio-MMIO transport (`vmm::devices::virtio`), with a
//! guest that controls every register access and every byte of its RAM. The device starts
//! as a driver leaves it (features negotiated, two queues of 16 set up, DRIVER_OK); the input
//! is then a sequence of operations: 8 bytes into RAM (descriptors, rings, buffers), a register
//! write or read of any width at any offset, a queue notification, a frame from the host. No
//! panic, and the state reached restores exactly into a second device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::net::{
    FrameSink, NetConfig, NetDevice, OFFERED_FEATURES, TxChecksum, VirtioNet,
};

const RAM: u64 = 1 << 20;

struct Discard;

impl FrameSink for Discard {
    fn transmit(&mut self, _: &[u8], _: TxChecksum) {}
}

struct NoIrq;

impl vm_superio::Trigger for NoIrq {
    type E = ();
    fn trigger(&self) -> Result<(), ()> {
        Ok(())
    }
}

fn device() -> NetDevice<Discard, NoIrq> {
    MmioTransport::new(VirtioNet::new(NetConfig::default(), Discard), NoIrq)
}

fn write(dev: &mut NetDevice<Discard, NoIrq>, mem: &GuestMemoryMmap, offset: u64, value: u32) {
    dev.write(offset, &value.to_le_bytes(), mem);
}

/// Negotiates every offered feature and sets up queue i (16 entries) at 64 KiB * (i + 1):
/// descriptors, then the available ring 4 KiB on, the used ring 8 KiB on.
fn start(dev: &mut NetDevice<Discard, NoIrq>, mem: &GuestMemoryMmap) {
    for status in [1, 3] {
        write(dev, mem, 0x70, status);
    }
    for sel in 0..2u32 {
        write(dev, mem, 0x24, sel);
        write(dev, mem, 0x20, (OFFERED_FEATURES >> (32 * sel)) as u32);
    }
    write(dev, mem, 0x70, 11);
    for queue in 0..2u32 {
        let desc = 0x1_0000 * u64::from(queue + 1);
        write(dev, mem, 0x30, queue);
        write(dev, mem, 0x38, 16);
        for (reg, addr) in [(0x80, desc), (0x90, desc + 0x1000), (0xa0, desc + 0x2000)] {
            write(dev, mem, reg, addr as u32);
            write(dev, mem, reg + 4, (addr >> 32) as u32);
        }
        write(dev, mem, 0x44, 1);
    }
    write(dev, mem, 0x70, 15);
}

fuzz_target!(|data: &[u8]| {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap();
    let mut dev = device();
    start(&mut dev, &mem);
    assert!(dev.is_running());

    let mut rest = data;
    while let Some((&op, args)) = rest.split_first() {
        let take = |n: usize| args.get(..n);
        let used = match op % 5 {
            0 => take(11).map(|a| {
                let addr = u64::from(u32::from_le_bytes([a[0], a[1], a[2], 0])) % RAM;
                // The last bytes of RAM take fewer than 8.
                let len = 8.min((RAM - addr) as usize);
                mem.write_slice(&a[3..3 + len], GuestAddress(addr)).unwrap();
                11
            }),
            1 => take(11).map(|a| {
                let offset = u64::from(u16::from_le_bytes([a[0], a[1]])) % 0x120;
                let len = [1, 2, 4, 8][usize::from(a[2] % 4)];
                dev.write(offset, &a[3..3 + len], &mem);
                11
            }),
            2 => take(3).map(|a| {
                let offset = u64::from(u16::from_le_bytes([a[0], a[1]])) % 0x1000;
                let mut buf = [0u8; 8];
                let len = [0, 1, 2, 4, 8][usize::from(a[2] % 5)];
                dev.read(offset, &mut buf[..len]);
                3
            }),
            3 => take(1).map(|a| {
                write(&mut dev, &mem, 0x50, u32::from(a[0] % 3));
                1
            }),
            _ => take(3).map(|a| {
                let len = u32::from_le_bytes([a[0], a[1], a[2], 0]) % 70_000;
                let frame: Vec<u8> = (0..len).map(|i| i as u8).collect();
                dev.receive_frame(&frame, &mem);
                3
            }),
        };
        let Some(used) = used else { break };
        rest = &args[used..];
    }

    let state = dev.net_state();
    let mut twin = device();
    twin.restore_net(&state, &mem)
        .expect("a state the device reached restores");
    assert_eq!(twin.net_state(), state);
});
