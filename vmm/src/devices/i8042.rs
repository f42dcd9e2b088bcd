//! The two i8042 ports a Linux guest touches: the status port (always "nothing pending") and the
//! command port, whose pulse-reset command is how a `reboot=k` guest asks to stop.

use crate::layout::{I8042_CMD_RESET, I8042_COMMAND_PORT, I8042_DATA_PORT};

/// What a write to the controller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum I8042Event {
    None,
    /// The guest pulsed the reset line: it rebooted, halted or panicked (`panic=-1`).
    Reset,
}

/// The i8042 keyboard controller, reduced to its reset line.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct I8042;

impl I8042 {
    /// Whether `port` belongs to this device.
    pub(crate) fn owns(port: u16) -> bool {
        port == I8042_DATA_PORT || port == I8042_COMMAND_PORT
    }

    /// A read: status 0 (output buffer empty, input buffer empty), data 0.
    pub(crate) fn read(&self, _port: u16) -> u8 {
        0
    }

    /// A write; only the reset command on the command port does anything.
    pub(crate) fn write(&mut self, port: u16, value: u8) -> I8042Event {
        if port == I8042_COMMAND_PORT && value == I8042_CMD_RESET {
            I8042Event::Reset
        } else {
            I8042Event::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_on_the_command_port_is_a_reset() {
        let mut kbd = I8042;

        assert_eq!(kbd.write(0x64, 0xfe), I8042Event::Reset);
        assert_eq!(kbd.write(0x60, 0xfe), I8042Event::None);
        assert_eq!(kbd.write(0x64, 0xff), I8042Event::None);
        assert_eq!(kbd.read(0x64), 0);
    }
}
