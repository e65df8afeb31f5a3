// Error-message checks shared by the model_io tests.
#pragma once

#include <string>

#include <catch2/catch.hpp>

// True when `msg` contains `what`; the whole message is logged with the assertion that uses it.
inline bool Mentions(const std::string& msg, const std::string& what) {
  INFO("message: " << msg);
  return msg.find(what) != std::string::npos;
}
