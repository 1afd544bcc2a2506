// Which device holds a unit's tensors: the engine's (EngineOptions::device),
// or the host for units registered on_host (UnitRegistration::on_host: CPU
// optimizer state beside GPU parameters). The engine and its restore choose
// each unit's copy path through this.
//
// Thread-safety: immutable after construction; Device methods are
// thread-safe.
#pragma once

#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::runtime {

class UnitDevices {
 public:
  // `device` is the engine's, not owned; it must outlive this object.
  explicit UnitDevices(Device& device) : device_(&device) {}

  Device& of(const UnitRegistration& unit) const { return unit.on_host ? host_ : *device_; }
  Device& engine_device() const { return *device_; }
  // Whether `device`'s copies are ordered by events (the engine records an
  // update event and copies wait for it): queued devices that the CPU
  // cannot address, never the host.
  static bool OrdersByEvents(const Device& device) {
    return device.orders_by_events() && !device.cpu_addressable();
  }

 private:
  Device* device_;
  mutable HostDevice host_;
};

}  // namespace pmsnap::runtime
