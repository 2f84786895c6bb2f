// The phases of JsonMatcher's frames, shared by the matcher (json_schema.cpp) and its completion distance
// (json_closing.cpp).
#pragma once
#include <cstdint>

namespace moesrv::json_phases {

enum ObjPhase : uint8_t { kObjFirst, kObjKey, kObjColon, kObjValue, kObjAfter, kObjNextKey };
enum ArrPhase : uint8_t { kArrFirst, kArrValue, kArrAfter, kArrNext };
enum NumPhase : uint8_t { kMinus = 1, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits };
enum StrPhase : uint8_t { kChars, kEscape, kHex, kDone };
inline const char* const kLiterals[] = {"true", "false", "null"};

}  // namespace moesrv::json_phases
